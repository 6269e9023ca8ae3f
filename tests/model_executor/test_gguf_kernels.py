"""The native GGUF block-quantized GEMM (kernels/quant_gemm.cpp) against the `gguf` package's own dequantization of
the same blocks: exact (float rounding) against the kernel's arithmetic - the dequantized weights times the
activations quantized to int8 per block of 32 - and close to the float product, for each type kept quantized, on
each instruction-set level this CPU runs (the default one in the fast tier, the others built on demand); and an MoE
layer's experts on GGUF blocks against the same blocks dequantized."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_files import random_k_blocks

from pagedserve.model_executor import kernels
from pagedserve.model_executor.layers.fused_moe import FusedMoE, fused_experts, select_experts
from pagedserve.model_executor.quantization.gguf import NATIVE_TYPES, GGUFConfig, type_runs

gguf = pytest.importorskip("gguf")

# the levels besides the default one that this CPU runs (a level it cannot run is not generated)
OTHER_LEVELS = [pytest.param(isa, marks=[pytest.mark.kernels_build(isa), pytest.mark.slow])
                for isa in ("avx512", "avx2", "generic") if isa in kernels.supported_isas()]


def _blocks(name: str, n: int, k: int, rng: np.random.Generator) -> tuple[np.ndarray, torch.Tensor]:
    """Random rows of type `name` ([n, row bytes] uint8) and their float64 dequantization."""
    qtype = gguf.GGMLQuantizationType[name]
    if name.endswith("_K"):  # gguf-py has no K-quant quantizer: random blocks with bounded scales
        raw = random_k_blocks(qtype, n, k, rng)
    else:
        raw = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    return raw, torch.from_numpy(gguf.quants.dequantize(raw, qtype)).double()


def _int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel multiplies it: rounded to int8 per block of 32 with scale max|x| / 127."""
    b = x.double().reshape(x.shape[0], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    return (torch.round(b / torch.where(d > 0, d, 1)) * d).reshape(x.shape)


def _on_int8_grid(x: torch.Tensor) -> torch.Tensor:
    """x moved onto its own int8 block grid: each value a whole multiple of its block's max|x| / 127, so the kernel's
    quantization divides to (nearly) whole numbers and meets no rounding tie, which the kernel (float) and the
    reference (double) would break differently (one step of 1/127, ~5e-4: a CI failure once)."""
    return _int8_blocks(x).to(x.dtype)


def _ops(isa: str | None):
    if isa is None:
        ops = kernels.cpu_kernels()
    elif isa not in kernels.supported_isas():
        pytest.skip(f"this CPU cannot run the {isa} build")
    else:
        ops = kernels.load_cpu_kernels(isa)
    if ops is None:
        pytest.skip("no native kernels")
    return ops


def _check_types(ops, dtype=torch.float32):
    rng = np.random.default_rng(0)
    for name, (type_id, _, _) in NATIVE_TYPES.items():
        assert ops.native_gguf_type(type_id)
        n, k = 40, 512  # 40: a padded last tile of 16 columns
        raw, w = _blocks(name, n, k, rng)
        packed = ops.gguf_repack(torch.from_numpy(raw), type_id, n, k)
        # 1 row (a 32-k type's two vectors at once), 2 and 4 rows (one vector at a time), 7: a decoded chunk's pass of
        # 4 rows and a tail of 3
        for m in (1, 2, 4, 7):
            x = _on_int8_grid(torch.randn(m, k, generator=torch.Generator().manual_seed(type_id * 10 + m))).to(dtype)
            y = ops.gguf_gemm(x, packed, torch.tensor([[type_id, n]]), None)
            assert y.dtype == dtype and y.shape == (m, n)
            exact = _int8_blocks(x) @ w.T
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            assert ((y.double() - exact).abs().max() / exact.abs().max()).item() < tol, (name, m)
            float_ref = x.double() @ w.T
            assert ((y.double() - float_ref).abs().max() / float_ref.abs().max()).item() < 3e-2, (name, m)


def test_gguf_gemm_types_default_level():
    _check_types(_ops(None))


def _check_many_rows(ops):
    """Beyond 4 rows the kernel unpacks each tile once, a chunk of 8 blocks of 32 at a time, and runs every row over
    it: row counts that fill passes of 4 and leave 1-3 over (5, 16, 33), K that ends in a partial chunk (320 = 10
    blocks) or spans three (768), rows of very different sizes (a row written to another row's place shows), against
    the dequantized reference and against each row multiplied alone (the unpack-in-registers path)."""
    rng = np.random.default_rng(4)
    for name, (type_id, block, _) in NATIVE_TYPES.items():
        n, k = 40, 320 if block == 32 else 768
        raw, w = _blocks(name, n, k, rng)
        packed, layout = ops.gguf_repack(torch.from_numpy(raw), type_id, n, k), torch.tensor([[type_id, n]])
        for m in (5, 16, 33):
            gen = torch.Generator().manual_seed(type_id * 100 + m)
            x = _on_int8_grid(torch.randn(m, k, generator=gen) * torch.logspace(-2, 2, m).unsqueeze(1))
            y = ops.gguf_gemm(x, packed, layout, None).double()
            exact = _int8_blocks(x) @ w.T
            rel = (y - exact).abs().amax(dim=1) / exact.abs().amax(dim=1)  # per row: the small rows count too
            assert rel.max().item() < 1e-5, (name, m, rel.argmax().item())
            alone = torch.cat([ops.gguf_gemm(x[r:r + 1], packed, layout, None) for r in range(m)]).double()
            assert ((y - alone).abs().amax(dim=1) / alone.abs().amax(dim=1)).max().item() < 1e-5, (name, m)


def test_gguf_gemm_many_rows_default_level():
    _check_many_rows(_ops(None))


@pytest.mark.parametrize("isa", OTHER_LEVELS)
def test_gguf_gemm_many_rows_other_levels(isa):
    _check_many_rows(_ops(isa))


@pytest.mark.parametrize("isa", OTHER_LEVELS)
def test_gguf_gemm_types_other_levels(isa):
    _check_types(_ops(isa))


# Each type's quantized-value bytes (block byte range) set to all ones: every weight at its type's largest value.
_VALUE_BYTES = {"Q4_0": (2, 18), "Q4_1": (4, 20), "Q5_0": (2, 22), "Q5_1": (4, 24), "Q4_K": (16, 144),
                "Q5_K": (16, 176), "Q6_K": (0, 192)}


def _check_largest_values(ops):
    """The largest weights (15 / 31 / 63) against full-scale activations (+-127 after quantization), where the
    non-VNNI levels' int16 sums of VPMADDUBSW pairs come nearest to overflowing: exact, not saturated."""
    rng = np.random.default_rng(3)
    n, k = 24, 512
    for name, (start, end) in _VALUE_BYTES.items():
        type_id, block, size = NATIVE_TYPES[name]
        raw, _ = _blocks(name, n, k, rng)
        blocks = raw.reshape(n, k // block, size)
        blocks[:, :, start:end] = 0xFF
        w = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])).double()
        packed = ops.gguf_repack(torch.from_numpy(raw), type_id, n, k)
        x = torch.tensor([[1.0] * k, [-1.0] * k, [1.0, -1.0] * (k // 2)])
        for rows in (x[:1], x):  # one row (its own path) and three
            y = ops.gguf_gemm(rows, packed, torch.tensor([[type_id, n]]), None)
            exact = rows.double() @ w.T
            assert ((y.double() - exact).abs().max() / exact.abs().max()).item() < 1e-5, (name, rows.shape[0])


def test_gguf_gemm_largest_values_default_level():
    _check_largest_values(_ops(None))


@pytest.mark.parametrize("isa", OTHER_LEVELS)
def test_gguf_gemm_largest_values_other_levels(isa):
    _check_largest_values(_ops(isa))


def test_gguf_gemm_bfloat16_activations():
    _check_types(_ops(None), torch.bfloat16)


def test_gguf_gemm_mixed_parts_and_bias():
    """A fused layer's shards of different types (Q4_K_M's Q4_K q/k and Q6_K v, and a Q8_0 one) side by side, with a
    bias: 3 rows (a tile at a time, but on AVX-512 Q8_0's shard in runs of three tiles) and 9 (AVX-512 runs three
    tiles of every shard at once: shards of 5 tiles (3, then 1 and 1), 1 and 3 (the last padded), never a run across
    two shards)."""
    ops, rng = _ops(None), np.random.default_rng(1)
    k, parts = 256, [("Q4_K", 80), ("Q8_0", 80), ("Q4_K", 16), ("Q6_K", 40)]
    packed, ws = [], []
    for name, n in parts:
        raw, w = _blocks(name, n, k, rng)
        packed.append(ops.gguf_repack(torch.from_numpy(raw), NATIVE_TYPES[name][0], n, k))
        ws.append(w)
    w = torch.cat(ws)
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(w.shape[0], generator=gen)
    layout = torch.tensor([[NATIVE_TYPES[name][0], n] for name, n in parts])
    for m in (3, 9):
        x = _on_int8_grid(torch.randn(m, k, generator=gen))
        y = ops.gguf_gemm(x, torch.cat(packed), layout, bias)
        exact = _int8_blocks(x) @ w.T + bias.double()
        assert ((y.double() - exact).abs().max() / exact.abs().max()).item() < 1e-5, m


def _int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x rounded to int8 with one scale per row, max|x| / 127 over the row (per-token quantization)."""
    d = x.double().abs().amax(-1, keepdim=True) / 127
    return torch.round(x.double() / torch.where(d > 0, d, 1)) * d


def _check_per_row_activations(ops):
    """per_row_activations: one activation scale per row over all of K, not one per block of 32 (W8A8 checkpoints'
    per-token activations); col_scale multiplies each output column before the bias. On Q8_0 blocks of scale 1,
    as a W8A8 weight runs where the build has no int8 small GEMM: the per-token int8 product exactly."""
    rng = np.random.default_rng(5)
    type_id = NATIVE_TYPES["Q8_0"][0]
    n, k = 40, 320
    q = torch.from_numpy(rng.integers(-127, 128, (n, k), dtype=np.int8))
    ones = np.full((n, k // 32, 1), 1.0, dtype=np.float16).view(np.uint8)  # each block's float16 scale: 1.0
    raw = np.concatenate([ones, q.numpy().view(np.uint8).reshape(n, k // 32, 32)], axis=2).reshape(n, -1)
    packed, layout = ops.gguf_repack(torch.from_numpy(raw), type_id, n, k), torch.tensor([[type_id, n]])
    col_scale = torch.from_numpy(rng.uniform(1e-3, 1e-2, n)).float()
    bias = torch.randn(n, generator=torch.Generator().manual_seed(5))
    for m in (1, 3, 16, 33):  # the in-register rows and the many-row chunks
        gen = torch.Generator().manual_seed(m)
        # rows of very different sizes, each block of a row much smaller than its largest: per block would differ
        x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 2, m).unsqueeze(1)
        x[:, :32] *= 50
        x = _int8_rows(x).float()  # on its own per-row grid: no rounding ties (see _on_int8_grid)
        y = ops.gguf_gemm(x, packed, layout, bias, col_scale, per_row_activations=True).double()
        exact = (_int8_rows(x) @ q.double().T) * col_scale.double() + bias.double()
        rel = (y - exact).abs().amax(dim=1) / exact.abs().amax(dim=1)
        assert rel.max().item() < 1e-5, (m, rel.argmax().item())
        per_block = ops.gguf_gemm(x, packed, layout, bias, col_scale).double()  # the default, a scale per block: off
        assert ((per_block - exact).abs().amax(dim=1) / exact.abs().amax(dim=1)).max().item() > 5e-5, m


def test_gguf_gemm_per_row_activations_and_column_scales_default_level():
    _check_per_row_activations(_ops(None))


@pytest.mark.parametrize("isa", OTHER_LEVELS)
def test_gguf_gemm_per_row_activations_and_column_scales_other_levels(isa):
    _check_per_row_activations(_ops(isa))


def _q8_0_blocks(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Q8_0 rows ([n, row bytes] uint8) of int8 values q [n, k] with float16 scales d [n, k / 32]."""
    n, k = q.shape
    scales = d.astype(np.float16).reshape(n, k // 32, 1).view(np.uint8)
    return np.concatenate([scales, q.view(np.uint8).reshape(n, k // 32, 32)], axis=2).reshape(n, -1)


def _check_q8_0_rows(ops):
    """Q8_0 at 2-4 rows (AVX2: one pass over both vectors of a tile) and beyond (the decoded chunks' passes of 4 and
    the 1-3 rows left over: 5, 6, 7, 9; 16 and 33), K of 22 blocks (a chunk of 8 blocks left partial), 40 columns (a
    padded tile), weights that include the int8 extremes -128 and 127 beside full-scale activations (+-127:
    VPMADDUBSW's pair sums nearest int16's limit, where an unsigned offset would saturate), rows of very different
    sizes; per block of 32 and per row with column scales (W8A8), against the dequantized weights times the int8
    activations in float64."""
    rng = np.random.default_rng(6)
    type_id = NATIVE_TYPES["Q8_0"][0]
    n, k = 40, 22 * 32
    q = rng.integers(-128, 128, (n, k), dtype=np.int8)
    q[:8, :64] = -128  # whole blocks at the extremes: the pair sums at +-2 x 128 x 127
    q[8:16, 64:128] = 127
    d = rng.uniform(0.5, 2.0, (n, k // 32))
    layout = torch.tensor([[type_id, n]])
    packed = ops.gguf_repack(torch.from_numpy(_q8_0_blocks(q, d)), type_id, n, k)
    d16 = torch.from_numpy(d.astype(np.float16).astype(np.float64))  # the scales as the blocks store them
    w = torch.from_numpy(q).double() * d16.repeat_interleave(32, 1)
    ones = ops.gguf_repack(torch.from_numpy(_q8_0_blocks(q, np.ones_like(d))), type_id, n, k)
    col_scale = torch.from_numpy(rng.uniform(1e-3, 1e-2, n)).float()
    for m in (2, 3, 4, 5, 6, 7, 9, 16, 33):
        gen = torch.Generator().manual_seed(600 + m)
        x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 2, m).unsqueeze(1)
        x[0, :128] = torch.where(torch.arange(128) % 3 == 0, -1.0, 1.0) * x[0].abs().max()  # +-127 on the extremes
        x = _on_int8_grid(x)
        y = ops.gguf_gemm(x, packed, layout, None).double()
        exact = _int8_blocks(x) @ w.T
        rel = (y - exact).abs().amax(dim=1) / exact.abs().amax(dim=1)
        assert rel.max().item() < 1e-5, (m, rel.argmax().item())
        x_rows = _int8_rows(x).float()
        y_rows = ops.gguf_gemm(x_rows, ones, layout, None, col_scale, per_row_activations=True).double()
        exact_rows = (_int8_rows(x_rows) @ torch.from_numpy(q).double().T) * col_scale.double()
        rel = (y_rows - exact_rows).abs().amax(dim=1) / exact_rows.abs().amax(dim=1)
        assert rel.max().item() < 1e-5, ("per row", m, rel.argmax().item())


def test_gguf_gemm_q8_0_rows_default_level():
    _check_q8_0_rows(_ops(None))


@pytest.mark.parametrize("isa", OTHER_LEVELS)
def test_gguf_gemm_q8_0_rows_other_levels(isa):
    _check_q8_0_rows(_ops(isa))


def test_gguf_gemm_rejects_mismatched_weight():
    ops = _ops(None)
    raw, _ = _blocks("Q4_0", 16, 64, np.random.default_rng(2))
    packed = ops.gguf_repack(torch.from_numpy(raw), NATIVE_TYPES["Q4_0"][0], 16, 64)
    with pytest.raises(RuntimeError, match="does not match"):
        ops.gguf_gemm(torch.randn(1, 128), packed, torch.tensor([[NATIVE_TYPES["Q4_0"][0], 16]]), None)
    assert not ops.native_gguf_type(11)  # Q3_K: dequantized at load instead


def test_type_runs():
    assert type_runs(torch.tensor([12, 12, 14, 14, 14, 12], dtype=torch.uint8)) == [(0, 2, 12), (2, 3, 14),
                                                                                     (5, 1, 12)]


@pytest.mark.parametrize("types", [("Q8_0", "Q8_0", "Q8_0"), ("Q4_0", "Q5_0", "Q4_1"), ("Q4_K", "Q4_K", "Q6_K"),
                                   ("Q5_K", "Q4_K", "Q5_1")])
@pytest.mark.parametrize("rows", [1, 40])  # 40: with 8 experts, the experts spread over the threads
@pytest.mark.parametrize("isa", [None, *OTHER_LEVELS])
def test_gguf_experts_layer_matches_dequantized_weights(types, rows, isa, monkeypatch):
    """The experts layer on its GGUF blocks (gate and up possibly of different types: two parts of one product) against
    the same blocks dequantized by the `gguf` package, through F.linear: within the int8 activations' rounding."""
    monkeypatch.setattr(kernels, "_default", _ops(isa))
    experts, hidden, inter = 8, 256, 256
    rng = np.random.default_rng(0)
    prefix = "layers.1.mlp.experts"
    config = GGUFConfig(checkpoint_config={"linear_types": {
        f"model.{prefix}.{p}": t for p, t in zip(("gate_proj", "up_proj", "down_proj"), types)}})
    layer = FusedMoE(experts, hidden, inter, config, prefix)
    for proj, type_name in zip(("gate_proj", "up_proj", "down_proj"), types):
        param = getattr(layer, f"{proj}_qweight")
        qtype, rows_k = gguf.GGMLQuantizationType[type_name], inter if proj == "down_proj" else hidden
        if type_name.endswith("_K"):
            blocks = random_k_blocks(qtype, param.shape[0] * param.shape[1], rows_k, rng)
        else:
            w = rng.standard_normal((param.shape[0] * param.shape[1], rows_k)).astype(np.float32) * 0.05
            blocks = gguf.quants.quantize(w, qtype)
        param.data.copy_(torch.from_numpy(blocks.reshape(param.shape)))
    w13, w2 = layer.method.dequantized(layer)
    layer.process_weights_after_loading()
    assert layer.native13 is not None and layer.native13.layout[:, 0].tolist() == [NATIVE_TYPES[t][0] for t in types[:2]]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, hidden, generator=gen)
    weights, ids = select_experts(torch.randn(rows, experts, generator=gen), 2, True)
    want = fused_experts(x, w13, w2, weights, ids)
    got = layer(x, weights, ids)
    assert ((got - want).norm() / want.norm()).item() < 0.03


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, 128])
def test_int4_weights_as_gguf_rows(symmetric, group_size):
    """4-bit checkpoint weights (int4.py: Int4Weights) as GGUF rows: Q4_0 for symmetric ones, exactly (float16
    scales, as GPTQ stores them); Q4_1 otherwise, its m the float16 rounding of lo; Q4_0 rows rewritten as Q4_1
    exactly; and None where blocks cannot hold them (act-order's input order, groups of 16)."""
    from pagedserve.model_executor.quantization.gguf import int4_gguf_rows, q4_0_as_q4_1
    from pagedserve.model_executor.quantization.int4 import Int4Weights

    gen = torch.Generator().manual_seed(0)
    n, k = 16, 256
    q = torch.randint(0, 16, (n, k), generator=gen)
    scale = (torch.rand(n, k // group_size, generator=gen) * 0.01 + 1e-3).half().float()
    zeros = torch.full_like(scale, 8) if symmetric else torch.randint(0, 16, scale.shape, generator=gen).float()
    weights = Int4Weights(q, scale, -zeros * scale, group_size, torch.float32)
    rows, type_name = int4_gguf_rows(weights)
    assert type_name == ("Q4_0" if symmetric else "Q4_1")
    got = torch.from_numpy(gguf.quants.dequantize(rows.numpy(), gguf.GGMLQuantizationType[type_name]))
    want = weights.dequantize()
    if symmetric:
        assert torch.equal(got, want)
        as_q4_1 = torch.from_numpy(gguf.quants.dequantize(q4_0_as_q4_1(rows).numpy(), gguf.GGMLQuantizationType.Q4_1))
        assert torch.equal(as_q4_1, want)
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=float(scale.max()) * 16 * 2 ** -10)
    assert int4_gguf_rows(Int4Weights(q, scale, -zeros * scale, group_size, torch.float32, torch.arange(k))) is None
    fine = group_size // 16  # the same weights in groups of 16
    assert int4_gguf_rows(Int4Weights(q, scale.repeat_interleave(fine, 1), (-zeros * scale).repeat_interleave(fine, 1),
                                      16, torch.float32)) is None
