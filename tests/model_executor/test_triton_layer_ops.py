"""The layers' small ops in Triton (pagedserve/model_executor/triton_layer_ops.py, the CUDA path) against PyTorch:
RMSNorm with and without the residual add, in place on strided per-head views, rotary in place, silu * mul. Without
a GPU they run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported); on a CUDA machine the
same tests run the compiled kernels (benchmarks/device_check.sh). Their compilation for sm_90 is checked by
test_triton_attention.py::test_kernels_compile_for_sm90."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # before triton is first imported: it patches triton.language then
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed (pip install -e '.[triton]')")

from pagedserve.model_executor import triton_layer_ops as tlo  # noqa: E402
from pagedserve.model_executor.attention.selector import get_attention_backend  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# float32: a few ulps (FMA contraction, IEEE division); 16-bit: one unit of the stored dtype (the interpreter
# truncates where the GPU rounds)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 100])  # 100: a padded block
def test_rms_norm_with_and_without_the_residual_add(dtype, n):
    x, res, w = randn(5, n, dtype=dtype, seed=1), randn(5, n, dtype=dtype, seed=2), randn(n, dtype=dtype, seed=3)
    close(tlo.rms_norm(x, None, w, 1e-6), F.rms_norm(x.float(), (n,), w.float(), 1e-6), dtype)
    summed = res + x  # rounded to the dtype, as the residual stream is
    residual = res.clone()
    out = tlo.rms_norm(x, residual, w, 1e-6)
    if dtype == torch.bfloat16 and INTERPRETED:  # Triton 3.9's interpreter truncates float32 -> bfloat16
        close(residual, summed, dtype)
    else:
        assert torch.equal(residual, summed)  # the residual add happened in place, rounded as PyTorch rounds
    close(out, F.rms_norm(summed.float(), (n,), w.float(), 1e-6), dtype)
    assert out.dtype == dtype and out.shape == x.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_in_place_on_strided_head_views(dtype):
    """Qwen3's q/k norms: [T, heads, D] views inside the QKV output (row stride = the QKV width), normed in place;
    the V columns next to them stay untouched."""
    t, q_heads, kv_heads, d = 3, 4, 2, 32
    qkv = randn(t, (q_heads + 2 * kv_heads) * d, dtype=dtype, seed=4)
    want = qkv.clone()
    qk = qkv[:, :(q_heads + kv_heads) * d].view(t, q_heads + kv_heads, d)
    w = randn(d, dtype=dtype, seed=5)
    ref = F.rms_norm(qk.float(), (d,), w.float(), 1e-6)
    tlo.rms_norm(qk, None, w, 1e-6, qk)
    close(qk, ref, dtype)
    assert torch.equal(qkv[:, (q_heads + kv_heads) * d:], want[:, (q_heads + kv_heads) * d:])


def test_rms_norm_refuses_a_residual_with_a_3d_x():
    x = torch.zeros(2, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="residual needs a 2-D x"):
        tlo.rms_norm(x, torch.zeros(2, 16, device=DEVICE), torch.ones(8, device=DEVICE), 1e-6)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the saturated gates, interpreted
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_over_several_column_tiles(dtype):
    n = tlo.SILU_BLOCK + 300  # two column tiles, the second partial
    gate_up = randn(3, 2 * n, dtype=dtype, seed=6)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -1e4])  # saturated and zero gates
    want = F.silu(gate_up[:, :n].float()) * gate_up[:, n:].float()
    got = tlo.silu_and_mul(gate_up)
    assert got.shape == (3, n) and got.dtype == dtype
    close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_a_strided_view(dtype):
    """q and k heads rotated together inside the QKV output (as the attention layer calls it), cos/sin as the
    rotary table gives them ([T, 1, D/2] float32); V untouched."""
    t, heads, v_heads, d = 4, 6, 2, 16
    qkv = randn(t, (heads + v_heads) * d, dtype=dtype, seed=7)
    before = qkv.clone()
    x = qkv[:, :heads * d].view(t, heads, d)
    angles = randn(t, 1, d // 2, dtype=torch.float32, seed=8)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    want = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    tlo.rotary_inplace(x, cos, sin)
    close(x, want, dtype)
    assert torch.equal(qkv[:, heads * d:], before[:, heads * d:])


def test_fused_ops_follow_the_attention_backend(monkeypatch):
    """Triton's small ops wherever attention runs on Triton: CUDA by default, a CPU only when asked (the engine
    tests that run the CUDA path on a CPU); the compiled CPU ops beside the CPU backend, none beside the PyTorch
    reference backend."""
    from pagedserve.model_executor.kernels import cpu_kernels

    monkeypatch.delenv("PAGEDSERVE_ATTENTION_BACKEND", raising=False)
    cpu = torch.zeros(2, 4)
    for choice, expected in (("auto", cpu_kernels()), ("cpu", cpu_kernels()), ("torch", None), ("triton", tlo)):
        backend = get_attention_backend(choice, cpu.device)
        assert backend.fused_ops(cpu) is expected, choice
        assert backend.fused_ops(cpu.to(torch.float64)) is None  # no fused op takes float64
    if torch.cuda.is_available():
        gpu = cpu.cuda()
        assert get_attention_backend("auto", gpu.device).fused_ops(gpu) is tlo
        assert get_attention_backend("torch", gpu.device).fused_ops(gpu) is None
