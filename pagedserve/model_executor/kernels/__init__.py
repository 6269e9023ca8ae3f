"""Native CPU kernels (paged decode attention, fused per-layer small ops), compiled on first use with the
local C++ compiler (torch.utils.cpp_extension).

If compiling fails (no compiler, no ninja), callers fall back to the pure PyTorch path; set
PAGEDSERVE_CPU_KERNELS=0 to force that path.
"""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

logger = logging.getLogger("pagedserve")


@functools.cache
def cpu_kernels():
    """The compiled module, or None when unavailable."""
    if os.environ.get("PAGEDSERVE_CPU_KERNELS", "1") == "0":
        return None
    logger.info("Loading the native CPU kernels (compiled on first use, then cached by torch).")
    try:
        from torch.utils.cpp_extension import load

        return load(
            name="pagedserve_cpu_kernels",
            sources=[str(Path(__file__).with_name(name)) for name in ("paged_attention.cpp", "layer_ops.cpp")],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler / ninja: the torch path still works
        logger.warning("Native CPU kernels unavailable (%s: %s); using the PyTorch path.", type(exc).__name__, exc)
        return None
