"""MXFP4 (OCP microscaling FP4, gpt-oss's expert weights): 32-value blocks of e2m1 numbers, two to a byte (low nibble
first), each block scaled by an e8m0 exponent (2^(scale - 127)). Read by dequantizing on load (models/gpt_oss.py):
the experts then run as float weights, or int8 with --quantization int8; native MXFP4 kernels are not built."""
from __future__ import annotations

import torch

# the sixteen e2m1 values by code: sign bit, two exponent bits, one mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks uint8 [E, ..., G, 16], scales uint8 [E, ..., G] -> [E, ..., G * 32] in `dtype` (bfloat16 holds every
    value exactly), one leading index at a time to bound the temporaries."""
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    out = torch.empty(*blocks.shape[:-2], blocks.shape[-2] * 32, dtype=dtype)
    for e in range(blocks.shape[0]):
        b = blocks[e].long()
        vals = torch.stack((lut[b & 0x0F], lut[b >> 4]), dim=-1).flatten(-2)  # [..., G, 32]
        out[e] = torch.ldexp(vals, scales[e].to(torch.int32).unsqueeze(-1) - 127).to(dtype).flatten(-2)
    return out
