"""What a build of the native CPU kernels can run on this CPU, derived from its instruction-set level and the CPU's
flags (not asked of the build, so a build that loses or gains an op fails test_kernels.py::test_build_capabilities
instead of silently shrinking a test matrix). Test matrices are generated from it: a case a build cannot run is not
generated (conftest deselects an empty parameter set), rather than skipped."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.model_executor import kernels as K


@dataclass(frozen=True)
class Capabilities:
    """What one build runs natively on this CPU."""
    isa: str
    prefill: bool  # native paged prefill attention (head_dim % 16 == 0)
    gemm_dtypes: tuple[torch.dtype, ...]  # weight dtypes small_gemm runs natively
    amx: bool  # AMX-BF16 tiles usable (bfloat16 attention and small GEMM)
    amx_int8: bool  # AMX-INT8 tiles too (the int8 small GEMM)
    lora_bf16_pairs: bool  # LoRA weights as bfloat16 pairs of k (VDPBF16PS)

    @property
    def amx_modes(self) -> tuple[bool, ...]:
        """The `amx` switch values worth a case: both on an AMX CPU, off only elsewhere."""
        return (True, False) if self.amx else (False,)


def capabilities(isa: str, flags: frozenset[str]) -> Capabilities:
    avx512, bf16 = isa.startswith("avx512"), isa == "avx512bf16"
    gemm = (torch.float32, torch.bfloat16, torch.int8) if bf16 else (torch.float32,) if avx512 else ()
    amx = bf16 and {"amx_tile", "amx_bf16"} <= flags
    return Capabilities(isa, prefill=avx512, gemm_dtypes=gemm, amx=amx, amx_int8=amx and "amx_int8" in flags,
                        lora_bf16_pairs=bf16)


def default_build() -> Capabilities:
    """The build the engine loads on this CPU (its best level, or PAGEDSERVE_CPU_ISA's)."""
    return capabilities(K.detect_isa(), K.cpu_flags())
