"""Weight-only int8 on the demo model: close perplexity, mostly the same greedy text."""
import sys
from pathlib import Path

from pagedserve.demo_model_path import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's tools/, outside the package
from tools.int8_quality import evaluate  # noqa: E402


def test_int8_quality_on_demo_model():
    r = evaluate(default_model_path(), max_tokens=4096, num_prompts=8, new_tokens=16)
    assert r["ppl_int8"] > r["ppl_fp32"] * 0.98  # quantization does not help
    assert r["ppl_delta_pct"] < 3.0, r
    if "ppl_int8_fbgemm" in r:  # fbgemm as well, where the engine's kernel is the native one
        assert r["ppl_int8_fbgemm"] > r["ppl_fp32"] * 0.98
        assert r["ppl_delta_fbgemm_pct"] < 3.0, r
    assert r["mean_common_prefix"] >= 0.5, r
