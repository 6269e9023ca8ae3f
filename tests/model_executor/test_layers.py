"""The layers: Linear on each of its quantization methods (the unquantized GEMM backends agree with F.linear at
every row count, on both sides of the MKL/oneDNN switch and of the native small GEMM / oneDNN switch, with a
pointwise activation fused or not; int8 within int8 noise), and the small ops with the CPU backend's fused kernels against PyTorch's."""
import pytest
import torch
import torch.nn.functional as F

from pagedserve.model_executor.layers.activation import POINTWISE_ACTIVATIONS
from pagedserve.model_executor.layers.linear import Linear
from pagedserve.model_executor.quantization.base import QuantizationConfig
from pagedserve.model_executor.quantization.int8 import NATIVE_INT8_MAX_ROWS, Int8Config
from pagedserve.model_executor.quantization.unquantized import (
    NATIVE_BF16_AMX_MAX_ROWS,
    NATIVE_BF16_NO_TILES_MAX_ROWS,
    NATIVE_GEMM_MAX_ROWS,
    ONEDNN_MIN_ROWS,
    UnquantizedConfig,
    onednn_takes,
)

from kernel_capabilities import default_build

# The bfloat16 small GEMM's cases exist only where the engine's build has it (AVX512-BF16 levels).
BF16_SMALL_GEMM = torch.bfloat16 in default_build().gemm_dtypes


def _linear(k: int, n: int, dtype: torch.dtype, quant_config: QuantizationConfig, bias: bool = False) -> Linear:
    """A Linear with random weights (and bias) in `dtype`, processed by its method as after loading."""
    g = torch.Generator().manual_seed(k * n)
    layer = Linear(k, n, bias, quant_config)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=g))
        if bias:
            layer.bias.copy_(torch.randn(n, generator=g))
    layer = layer.to(dtype)
    layer.process_weights_after_loading()
    return layer


def _random_layer(k: int, n: int, rows: int, dtype: torch.dtype, quant_config: QuantizationConfig):
    """A Linear with random weights and bias, an input of `rows` rows and the float32 reference output."""
    g = torch.Generator().manual_seed(rows)
    reference = _linear(k, n, dtype, UnquantizedConfig("torch"), bias=True)
    layer = _linear(k, n, dtype, quant_config, bias=True)
    x = torch.randn(rows, k, generator=g).to(dtype)
    return layer, x, F.linear(x.float(), reference.weight.float(), reference.bias.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "onednn", "native"])
@pytest.mark.parametrize("rows", [1, ONEDNN_MIN_ROWS - 1, ONEDNN_MIN_ROWS, NATIVE_BF16_NO_TILES_MAX_ROWS,
                                  NATIVE_BF16_NO_TILES_MAX_ROWS + 1, NATIVE_BF16_AMX_MAX_ROWS,
                                  NATIVE_BF16_AMX_MAX_ROWS + 1, NATIVE_GEMM_MAX_ROWS, NATIVE_GEMM_MAX_ROWS + 1])
def test_linear_backends_match_f_linear(backend, rows, dtype):
    if backend != "torch" and not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    # K not a multiple of 16, N not of 16: the tails
    layer, x, expected = _random_layer(100, 163, rows, dtype, UnquantizedConfig(backend))
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(layer(x).float(), expected, atol=tol * 10, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("rows", [0, 3, NATIVE_GEMM_MAX_ROWS + 1])
@pytest.mark.parametrize("act", sorted(POINTWISE_ACTIVATIONS))
def test_linear_with_activation_matches_activation_of_f_linear(act, rows, backend, dtype):
    """Linear(x, activation): on oneDNN (rows past the native small GEMM's) the activation is the GEMM's post-op,
    elsewhere it follows the product; no rows: an empty product (no kernel call)."""
    if backend != "torch" and not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    layer, x, expected = _random_layer(100, 163, rows, dtype, UnquantizedConfig(backend))
    activation = POINTWISE_ACTIVATIONS[act]
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    got = layer(x, activation)
    assert got.shape == (rows, 163) and got.dtype == dtype
    torch.testing.assert_close(got.float(), activation.fn(expected), atol=tol * 10, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_backend_packs_where_the_kernel_runs(dtype):
    """The "native" backend takes the small GEMM exactly where the build runs the dtype (else it is oneDNN), and
    hands products above NATIVE_GEMM_MAX_ROWS to oneDNN."""
    from pagedserve.model_executor.kernels import cpu_kernels

    ops = cpu_kernels()
    if ops is None or not torch.backends.mkldnn.is_available():
        pytest.fail("the native CPU kernels (and oneDNN) are needed here")
    layer = _linear(64, 40, dtype, UnquantizedConfig("native"))
    assert (layer.native_decode_tensors() is not None) == ops.native_small_gemm(dtype)
    one_copy = ops.native_small_gemm(dtype) and onednn_takes(dtype)  # one float copy, not two
    assert layer.weight.numel() == (0 if one_copy else 64 * 40)
    odd = _linear(33, 8, dtype, UnquantizedConfig("native"))
    assert (odd.native_decode_tensors() is not None) == (ops.native_small_gemm(dtype) and dtype == torch.float32)
    onednn = _linear(64, 40, dtype, UnquantizedConfig("onednn"))
    assert onednn.native_decode_tensors() is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["onednn", "native"])
def test_linear_without_onednn_for_the_dtype_keeps_the_weight(backend, dtype, monkeypatch):
    """Where oneDNN cannot pack the dtype (bfloat16 on an AVX2-only CPU: its reorder raises) the layer loads, keeps
    its float weight and runs the rows the small GEMM does not take on F.linear."""
    from pagedserve.model_executor.quantization import unquantized

    monkeypatch.setattr(unquantized, "onednn_takes", lambda dt: False)
    for rows in (1, NATIVE_GEMM_MAX_ROWS + 1):
        layer, x, expected = _random_layer(100, 163, rows, dtype, UnquantizedConfig(backend))
        assert layer.onednn_weight is None and layer.weight.numel() == 100 * 163
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(layer(x).float(), expected, atol=tol * 10, rtol=tol)


class _WithoutBf16SmallGemm:
    """The native kernels as an AVX2 CPU has them: no bfloat16 on the small GEMM."""

    def __init__(self, ops) -> None:
        self._ops = ops

    def __getattr__(self, name: str):
        return getattr(self._ops, name)

    def native_small_gemm(self, dtype: torch.dtype, k: int = 0) -> bool:
        return dtype != torch.bfloat16 and self._ops.native_small_gemm(dtype, k)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 16, 130])
def test_bf16_weight_gemm_matches_the_float32_product(rows):
    """bf16_weight_gemm (bfloat16 weights on CPUs without bfloat16 arithmetic): float32 x gives the float32 product
    of the widened weights; bfloat16 x its rounding; rows and columns past the kernel's 3 x 4 tiles, with a bias."""
    from pagedserve.model_executor.kernels import cpu_kernels

    ops = cpu_kernels()
    if ops is None or not ops.native_bf16_weight_gemm(104):
        pytest.skip("no bf16_weight_gemm in this build (AVX2 and up)")
    assert not ops.native_bf16_weight_gemm(100)  # K in steps of 8
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(163, 104, generator=g).bfloat16()
    x, bias = torch.randn(rows, 104, generator=g), torch.randn(163, generator=g)
    expected = F.linear(x, w.float(), bias)
    torch.testing.assert_close(ops.bf16_weight_gemm(x, w, bias), expected, atol=1e-4, rtol=1e-5)
    got = ops.bf16_weight_gemm(x.bfloat16(), w, bias.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.linear(x.bfloat16().float(), w.float(), bias.bfloat16().float()),
                               atol=5e-2, rtol=1e-2)
    with pytest.raises(RuntimeError, match="weight \\[N, K\\] bfloat16"):
        ops.bf16_weight_gemm(x, w.float(), None)


@pytest.mark.parametrize("rows", [1, 5, NATIVE_GEMM_MAX_ROWS + 1])
def test_bf16_linear_without_small_gemm_or_onednn_runs_bf16_weight_gemm(rows, monkeypatch):
    """Where neither the small GEMM nor oneDNN takes bfloat16 (AVX2: forced here), the "native" backend keeps the
    bfloat16 weight (one copy) and runs every row count on bf16_weight_gemm, 2-D and 3-D inputs."""
    from pagedserve.model_executor.kernels import cpu_kernels
    from pagedserve.model_executor.quantization import unquantized

    ops = cpu_kernels()
    if ops is None or not ops.native_bf16_weight_gemm(104):
        pytest.skip("no bf16_weight_gemm in this build (AVX2 and up)")
    monkeypatch.setattr(unquantized, "onednn_takes", lambda dt: dt != torch.bfloat16)
    monkeypatch.setattr(unquantized, "cpu_kernels", lambda: _WithoutBf16SmallGemm(ops))
    layer, x, expected = _random_layer(104, 163, rows, torch.bfloat16, UnquantizedConfig("native"))
    assert layer.bf16_weight_gemm and layer.small_gemm_weight is None and layer.weight.shape == (163, 104)
    torch.testing.assert_close(layer(x).float(), expected, atol=0.5, rtol=5e-2)
    torch.testing.assert_close(layer(x.view(1, rows, 104)).view(rows, 163), layer(x))
    odd, _, _ = _random_layer(100, 163, rows, torch.bfloat16, UnquantizedConfig("native"))  # K = 100: F.linear
    assert not odd.bf16_weight_gemm


@pytest.mark.parametrize("amx", [False, True] if BF16_SMALL_GEMM else [])
def test_bf16_small_gemm_row_limit_follows_amx(amx, monkeypatch):
    """On an AMX CPU bfloat16 products above native_gemm_max_rows go to oneDNN: NATIVE_BF16_AMX_MAX_ROWS where the
    kernel runs on the tiles, NATIVE_BF16_NO_TILES_MAX_ROWS where it cannot; float32 keeps the native kernel up to
    NATIVE_GEMM_MAX_ROWS, and elsewhere both dtypes do. int8 weights run the native kernel at every row count where
    it runs them at all (NATIVE_INT8_MAX_ROWS: no limit), AMX-INT8 tiles or VPDPBUSD."""
    from pagedserve.model_executor.kernels import cpu_kernels
    from pagedserve.model_executor.quantization import int8, unquantized

    ops = cpu_kernels()
    if ops is None:
        pytest.skip("native kernels disabled (PAGEDSERVE_CPU_KERNELS=0)")
    assert ops.native_small_gemm(torch.bfloat16)
    bf16_limit = NATIVE_GEMM_MAX_ROWS
    if amx:
        bf16_limit = NATIVE_BF16_AMX_MAX_ROWS if ops.amx_tiles() else NATIVE_BF16_NO_TILES_MAX_ROWS
    calls = []

    class Counting:  # the real kernels, counting the small GEMM's calls
        def __getattr__(self, name):
            return getattr(ops, name)

        def small_gemm(self, x, *args):
            calls.append(x.shape[0])
            return ops.small_gemm(x, *args)

        def small_gemm_int8(self, x, *args):
            calls.append(x.shape[0])
            return ops.small_gemm_int8(x, *args)

    flags = {"avx512_bf16", "amx_bf16", "amx_int8"} if amx else {"avx512_bf16"}
    monkeypatch.setattr(unquantized, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(unquantized, "cpu_kernels", lambda: Counting())
    monkeypatch.setattr(int8, "cpu_kernels", lambda: Counting())
    for dtype, limit in ((torch.bfloat16, bf16_limit), (torch.float32, NATIVE_GEMM_MAX_ROWS)):
        assert unquantized.native_gemm_max_rows(dtype) == limit
        layer = _linear(64, 48, dtype, UnquantizedConfig("native"))
        assert layer.native_decode_tensors().max_rows == limit
        for rows in (1, limit, limit + 1):
            calls.clear()
            layer(torch.randn(rows, 64).to(dtype))
            assert calls == ([rows] if rows <= limit else []), (dtype, rows)
    layer = _linear(64, 48, torch.float32, Int8Config())
    assert layer.native_decode_tensors().max_rows == NATIVE_INT8_MAX_ROWS
    for rows in (1, 17, 300, 2048):
        calls.clear()
        layer(torch.randn(rows, 64))
        assert calls == [rows], ("int8", rows)


@pytest.mark.parametrize("rows", [1, 2, 15, 16, 17, 31, 32, 33, 64, 65] if BF16_SMALL_GEMM else [])
@pytest.mark.parametrize("k, n, bias", [(576, 960, False), (1536, 584, True), (64, 40, True), (96, 16, False)])
def test_bf16_small_gemm_on_amx_tiles_and_vdpbf16ps(rows, k, n, bias):
    """The bfloat16 small GEMM with and without AMX tiles (where the CPU and OS give them: K % 32 == 0)
    against a float32 product: row tiles of 16 and 32, odd block counts (584 = 36.5 x 16), bias."""
    from pagedserve.model_executor.kernels import cpu_kernels

    ops = cpu_kernels()
    if ops is None:
        pytest.skip("native kernels disabled (PAGEDSERVE_CPU_KERNELS=0)")
    assert ops.native_small_gemm(torch.bfloat16, k)
    g = torch.Generator().manual_seed(rows * k)
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(rows, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    expected = x.float() @ w.float().T + (b.float() if bias else 0)
    packed = ops.pack_small_gemm_weight(w)
    tiles = ops.amx_tiles()
    try:
        for use_tiles in ((True, False) if tiles else (False,)):
            assert ops.set_amx_tiles(use_tiles) == use_tiles
            y = ops.small_gemm(x, packed, n, b)
            assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
            torch.testing.assert_close(y.float(), expected, atol=0.05 * expected.abs().max().item(), rtol=2e-2)
    finally:
        ops.set_amx_tiles(True)


def _native_vs_torch(fn, monkeypatch):
    """fn() with the compiled ops, then with the PyTorch fallback."""
    from pagedserve.model_executor.kernels import cpu_kernels

    if cpu_kernels() is None:
        pytest.fail("the native CPU kernels did not build (needs a C++ compiler and ninja)")
    native = fn()
    monkeypatch.setattr("pagedserve.model_executor.attention.cpu.cpu_kernels", lambda: None)
    return native, fn()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_fused_norm_rotary_silu_match_pytorch(rows, dtype, monkeypatch):
    """The layers with the native ops and with the PyTorch fallback, in the model's dtype (a bfloat16 model has
    bfloat16 norm weights and rotary tables: model.to(dtype) converts the buffers too)."""
    from pagedserve.model_executor.attention.cpu import CpuAttentionBackend
    from pagedserve.model_executor.layers.activation import silu_and_mul
    from pagedserve.model_executor.layers.norm import RMSNorm
    from pagedserve.model_executor.layers.rotary import RotaryEmbedding, apply_rotary

    g = torch.Generator().manual_seed(rows)
    norm = RMSNorm(80, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(80, generator=g))
    norm = norm.to(dtype)
    x, residual = torch.randn(rows, 80, generator=g).to(dtype), torch.randn(rows, 80, generator=g).to(dtype)
    gate_up = torch.randn(rows, 2 * 48, generator=g).to(dtype)
    heads, kv_heads, d = 6, 2, 32
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    rotary = RotaryEmbedding(d, 4096, 10000.0, None).to(dtype)
    cos_sin = rotary.cos_sin(torch.randint(0, 4096, (rows,), generator=g))

    def run():  # the CPU backend's fused ops where its kernels load, else PyTorch's ops
        backend = CpuAttentionBackend(torch.device("cpu"))
        norm.attn_backend = backend
        res = residual.clone()
        fused = norm(x, res)
        qk = qkv.clone()[:, :(heads + kv_heads) * d].view(rows, heads + kv_heads, d)  # strided, as in the model
        return (norm(x), fused, res, silu_and_mul(gate_up, backend.fused_ops(gate_up)),
                apply_rotary(qk, cos_sin, backend.fused_ops(qk)))

    native, reference = _native_vs_torch(run, monkeypatch)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    for a, b in zip(native, reference):
        assert a.dtype == b.dtype == dtype
        torch.testing.assert_close(a, b, **tol)
    torch.testing.assert_close(native[2], residual + x)  # the residual stream was updated in place


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 17, 300])
@pytest.mark.parametrize("allow_native", [True, False])
def test_int8_backend_close_to_float_on_both_kernels(rows, dtype, allow_native):
    """Weight-only int8 within int8 noise of the float product, on the native kernel (where the CPU's build has it;
    then it holds the only int8 copy) and on fbgemm (the path of the other builds); [batch, seq, K] inputs too."""
    from pagedserve.model_executor.kernels import cpu_kernels

    layer, x, expected = _random_layer(128, 163, rows, dtype, Int8Config(allow_native=allow_native))
    ops = cpu_kernels()
    native = allow_native and ops is not None and ops.native_small_gemm(torch.int8, 128)
    assert (layer.native_decode_tensors() is not None) == native
    assert (layer.fbgemm_weight is None) == native  # one packed int8 copy, never two
    assert layer.weight.numel() == 0  # and no float copy
    y = layer(x)
    assert y.dtype == dtype
    err = (y.float() - expected).abs().max() / expected.abs().max()
    assert err < 0.03, err
    torch.testing.assert_close(layer(x.view(1, rows, 128)).view(rows, 163), y)
