"""Weight-only int8 on the demo model: close perplexity, mostly the same greedy text."""
import sys
from pathlib import Path

import pytest

from pagedserve.demo_model_path import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's tools/, outside the package
from tools.int8_quality import evaluate  # noqa: E402


@pytest.mark.slow
def test_int8_quality_on_demo_model():
    r = evaluate(default_model_path(), max_tokens=4096, num_prompts=8, new_tokens=16)
    assert r["ppl_int8"] > r["ppl_fp32"] * 0.98  # quantization does not help
    assert r["ppl_delta_pct"] < 3.0, r
    if "ppl_int8_fbgemm" in r:  # fbgemm as well, where the engine's kernel is the native one
        assert r["ppl_int8_fbgemm"] > r["ppl_fp32"] * 0.98
        assert r["ppl_delta_fbgemm_pct"] < 3.0, r
    assert r["mean_common_prefix"] >= 0.5, r


def test_quantization_registry_names_and_errors():
    """`--quantization` values come from the registry; each gives every linear its method; a bad name or a device
    the format does not run on is a clear ValueError (offline and from EngineArgs)."""
    import pytest
    import torch

    from pagedserve.config import EngineArgs
    from pagedserve.model_executor.layers.linear import Linear
    from pagedserve.model_executor.quantization.int8 import Int8Config, Int8LinearMethod
    from pagedserve.model_executor.quantization.registry import (
        QUANTIZATION_METHODS,
        get_quantization_config,
    )
    from pagedserve.model_executor.quantization.unquantized import (
        UnquantizedConfig,
        UnquantizedLinearMethod,
    )

    cpu = torch.device("cpu")
    assert set(QUANTIZATION_METHODS) == {"int8", "int4", "gptq", "awq", "compressed-tensors", "fp8",
                                         "gguf"}
    int8 = get_quantization_config("int8", "auto", cpu)
    assert isinstance(int8, Int8Config)
    assert isinstance(Linear(8, 4, False, int8, "layers.0.mlp.down_proj").linear_method, Int8LinearMethod)
    plain = get_quantization_config(None, "onednn", cpu)
    assert isinstance(plain, UnquantizedConfig) and plain.method.backend == "onednn"
    assert isinstance(Linear(8, 4, True, plain).linear_method, UnquantizedLinearMethod)
    assert get_quantization_config(None, "native", torch.device("meta")).method.backend == "torch"  # CPU kernels only
    with pytest.raises(ValueError, match="quantization must be None or one of int8, int4, gptq, awq, "
                                         "compressed-tensors, fp8, gguf, got 'bnb'"):
        get_quantization_config("bnb", "auto", cpu)
    with pytest.raises(ValueError, match="int8' is implemented for the CPU only"):
        get_quantization_config("int8", "auto", torch.device("meta"))
    with pytest.raises(ValueError, match="linear_backend must be one of auto, torch, onednn, native"):
        get_quantization_config(None, "blas", cpu)
    with pytest.raises(ValueError, match="quantization must be None or one of int8"):
        EngineArgs(quantization="fp4")
