"""Paged attention in Triton: the CUDA backend ("auto" picks it on a GPU when Triton imports; attention/selector.py).

Every kernel reads the KV cache in place through block tables: no gather into a padded copy, no mask tensors.
Cache layout: two contiguous token-major tensors per layer, [num_blocks, block_size, num_kv_heads, head_dim] for K
and for V (written by flat slot), any of float32/bfloat16/float16; arithmetic is float32 (online softmax), the
output is written in the query's dtype. The layers' small ops run in Triton beside it (triton_layer_ops.py), and
decode steps may be captured as CUDA graphs (cuda_graphs.py): the K/V write skips padding rows.

  * write_kv: one program per new token stores its K and V at slot_mapping[token]; a negative slot is a padding
    row (a CUDA graph's batch padded to a captured size) and writes nothing.
  * decode: one query token per row. A program takes one row, one KV head and one partition of the context
    (split-K: a long context is cut into PARTITION tokens so a small batch still fills the GPU), scores the
    KV head's whole group of query heads (GQA: K/V read once per group; the group padded to 16 rows for a
    tensor-core dot) and keeps an unnormalised partial output
    with its running max and sum; a second small kernel merges the partitions (log-sum-exp). The number of
    partitions follows the block table's width, so a CUDA graph (static width) keeps one grid.
  * prefill chunk: one program per (tile of BLOCK_M query rows, query head) walks the chunk's context through its
    block table in tiles of BLOCK_N tokens up to its last row's position: causal with an offset (the chunk's
    first token sits at position context_len - num_tokens), so a later chunk sees its earlier context too.
  * sliding window (Mistral, Qwen2, Gemma's sliding layers: a query sees its last `window` positions): the decode
    partitions and the prefill tiles start at the window's first tile, so a windowed layer reads about a window
    of K/V whatever the context; a logits soft cap (Gemma 2: scores -> cap * tanh(scores / cap)) is applied to the
    scores of each tile before the online softmax; attention sinks (gpt-oss: a logit per query head in each
    softmax's denominator, with no value) join at the end, in the decode merge and after a prefill row's last tile.

Without a GPU these kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before this module is imported):
that is how CI checks them against a PyTorch reference (tests/model_executor/test_triton_attention.py).
"""
from __future__ import annotations

from types import ModuleType

import torch
import triton
import triton.language as tl

from pagedserve import envs
from pagedserve.model_executor import triton_layer_ops
from pagedserve.model_executor.attention.backend import AttentionBackend
from pagedserve.model_executor.attention.metadata import AttentionMetadata

# Tokens per split-K partition of a decode row: enough work per program to hide the K/V loads' latency, few
# enough partitions that a batch of one still spreads a long context over many SMs.
DECODE_PARTITION = 512
DECODE_BLOCK_N = 32  # tokens per K/V tile inside a partition
PREFILL_BLOCK_M = 64  # query rows per prefill program
PREFILL_BLOCK_N = 64  # context tokens per tile
# Triton's interpreter (3.9) computes a bfloat16 tl.dot wrongly, so there bfloat16 attention takes the float32
# dot (the same kernels, operands upcast); bfloat16 tensor-core dots are checked on a GPU only.
INTERPRETED = envs.TRITON_INTERPRET


def _fp32_dot(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or (INTERPRETED and dtype == torch.bfloat16)


@triton.jit
def _dot(a, b, FP32: tl.constexpr):
    """a @ b with float32 accumulation: exact float32 (no TF32 rounding, so a float32 model's greedy outputs match
    the float32 CPU path) when FP32, else tensor cores on the operands' 16-bit dtype."""
    if FP32:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_ptr, n, n_mask, visible, kv_head, d, d_mask, scale,
                 soft_cap, stride_cb, stride_cs, stride_ch, BLOCK_SIZE: tl.constexpr, FP32_DOT: tl.constexpr,
                 SOFT_CAP: tl.constexpr):
    """Folds one tile of context tokens `n` (found through the block table at table_ptr) into the online-softmax
    state (running max m_i, sum l_i, unnormalised output acc) of the query rows q; visible [rows, N] says which
    (query, key) pairs count; with SOFT_CAP the scores are capped at soft_cap first. Returns the new state."""
    block = tl.load(table_ptr + n // BLOCK_SIZE, mask=n_mask, other=0)
    kv_off = block * stride_cb + (n % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    s = _dot(q, tl.trans(k), FP32_DOT) * scale
    if SOFT_CAP:  # cap * tanh(s / cap), tanh(x) = 2 sigmoid(2x) - 1
        s = soft_cap * (2.0 * tl.sigmoid(2.0 * s / soft_cap) - 1.0)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # a row that has seen no visible key yet (a tile before its window) keeps max -inf: subtract 0 there, not -inf
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + _dot(p.to(q.dtype), v, FP32_DOT)


@triton.jit
def _with_sink(m, total, sink):
    """(factor, denominator) that fold a sink logit into a softmax of running max m and sum total (of exp(s - m)):
    the output is acc * factor / denominator, both taken about max(m, sink) so that no exponent overflows."""
    top = tl.maximum(m, sink)
    factor = tl.exp(m - top)
    return factor, total * factor + tl.exp(sink - top)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cs, stride_ch,  # cache strides over flat slots and heads (head_dim contiguous)
                     num_kv_heads, head_dim,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < num_kv_heads) & (d < head_dim)
        dst = slot * stride_cs + h * stride_ch + d
        k = tl.load(k_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        v = tl.load(v_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, KVH, D] (head_dim contiguous, any token/head strides: views of the QKV output)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        num_kv_heads, head_dim,
        # tiles of at least 2: no size-1 dimension for the compiler to special-case
        BLOCK_H=max(2, triton.next_power_of_2(num_kv_heads)), BLOCK_D=max(2, triton.next_power_of_2(head_dim)))


@triton.jit
def _decode_partition_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, context_lens_ptr,
                             part_out_ptr, part_max_ptr, part_sum_ptr, scale, window, soft_cap,
                             stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt,
                             num_heads, head_dim, group_size, num_partitions,
                             BLOCK_SIZE: tl.constexpr, PARTITION: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, FP32_DOT: tl.constexpr,
                             WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + row).to(tl.int32)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * group_size + g
    g_mask = g < group_size
    d_mask = d < head_dim
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    start = part * PARTITION
    end = tl.minimum(start + PARTITION, context_len)
    lo = 0  # the first visible position: the window's
    if WINDOW:
        lo = tl.maximum(context_len - window, 0)
    # [G, N] scores: the group's query heads padded to 16 rows; from the tile holding `lo` (a partition before
    # the window runs no tile: max -inf, sum 0, merged away)
    for tile in range(tl.maximum(start, lo - lo % BLOCK_N), end, BLOCK_N):
        n = tile + tl.arange(0, BLOCK_N)
        n_mask = (n < end) & (n >= lo)
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_table_ptr + row * stride_bt,
                                     n, n_mask, n_mask[None, :], kv_head, d, d_mask, scale, soft_cap,
                                     stride_cb, stride_cs, stride_ch, BLOCK_SIZE, FP32_DOT, SOFT_CAP)
    # partials laid out [row, head, partition(, dim)]; an empty partition leaves max -inf, sum 0
    part_idx = (row * num_heads + heads) * num_partitions + part
    tl.store(part_max_ptr + part_idx, m_i, mask=g_mask)
    tl.store(part_sum_ptr + part_idx, l_i, mask=g_mask)
    tl.store(part_out_ptr + part_idx[:, None] * head_dim + d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_reduce_kernel(part_out_ptr, part_max_ptr, part_sum_ptr, out_ptr, sinks_ptr, stride_ot, stride_oh,
                          num_heads, head_dim, num_partitions,
                          BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, SINKS: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    p = tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    p_mask = p < num_partitions
    base = (row * num_heads + head) * num_partitions
    m = tl.load(part_max_ptr + base + p, mask=p_mask, other=float("-inf"))
    # floored: a row with no context at all (a padding row) has every max -inf, and its output must be 0, not NaN
    m_max = tl.maximum(tl.max(m, axis=0), -1e30)
    weight = tl.exp(m - m_max)
    total = tl.sum(tl.load(part_sum_ptr + base + p, mask=p_mask, other=0.0) * weight, axis=0)
    acc = tl.load(part_out_ptr + (base + p)[:, None] * head_dim + d[None, :],
                  mask=p_mask[:, None] & (d < head_dim)[None, :], other=0.0)
    o = tl.sum(acc * weight[:, None], axis=0)
    if SINKS:  # the head's sink joins the merged denominator once
        factor, total = _with_sink(m_max, total, tl.load(sinks_ptr + head).to(tl.float32))
        o = o * factor
    o = o / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < head_dim)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, out: torch.Tensor,
                     partition: int = DECODE_PARTITION, block_n: int = DECODE_BLOCK_N,
                     window: int | None = None, soft_cap: float | None = None,
                     sinks: torch.Tensor | None = None) -> None:
    """q, out: [R, H, D] (head_dim contiguous); block_tables [R, W]; context_lens [R] (0: a padding row, out 0).
    Partitions = ceil(W * block_size / partition): fixed by the table's width, not by the lengths' values.
    window: each row sees its last this many positions; soft_cap: scores capped; sinks: [H] logits in each
    softmax's denominator (all None: none of them)."""
    if block_n < 16:  # the interpreter runs smaller tiles; the GPU compiler refuses them
        raise ValueError(f"decode tiles of {block_n} tokens: tl.dot needs K >= 16 on a GPU")
    rows, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_partitions = triton.cdiv(block_tables.shape[1] * block_size, partition)
    part_out = torch.empty((rows, num_heads, num_partitions, head_dim), dtype=torch.float32, device=q.device)
    part_max = torch.empty((rows, num_heads, num_partitions), dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs every dimension >= 16
    _decode_partition_kernel[(rows, num_kv_heads, num_partitions)](
        q, k_cache, v_cache, block_tables, context_lens, part_out, part_max, part_sum, scale, window or 0,
        soft_cap or 1.0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        num_heads, head_dim, group, num_partitions,
        BLOCK_SIZE=block_size, PARTITION=partition, BLOCK_N=block_n,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, FP32_DOT=_fp32_dot(q.dtype),
        WINDOW=window is not None, SOFT_CAP=soft_cap is not None)
    _decode_reduce_kernel[(rows, num_heads)](
        part_out, part_max, part_sum, out, part_max if sinks is None else sinks, out.stride(0), out.stride(1),
        num_heads, head_dim, num_partitions,
        BLOCK_P=max(2, triton.next_power_of_2(num_partitions)), BLOCK_D=block_d, SINKS=sinks is not None)


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_ids_ptr, out_ptr, sinks_ptr, scale, window, soft_cap,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch,
                    num_tokens, first_pos, head_dim, group_size,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    FP32_DOT: tl.constexpr, WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, SINKS: tl.constexpr):
    tile_m = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // group_size
    m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m_mask = m < num_tokens
    d_mask = d < head_dim
    q = tl.load(q_ptr + m[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = first_pos + m  # the rows' positions in the whole context
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # the tile's last row sees the context up to its own position (causal with the chunk's offset)
    end = first_pos + tl.minimum((tile_m + 1) * BLOCK_M, num_tokens)
    lo = 0  # the tile's first row's window starts here; each row's own lower bound is in `visible`
    if WINDOW:
        lo = tl.maximum(first_pos + tile_m * BLOCK_M - window + 1, 0)
    for tile in range(lo - lo % BLOCK_N, end, BLOCK_N):
        n = tile + tl.arange(0, BLOCK_N)
        n_mask = n < end
        visible = (n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if WINDOW:
            visible = visible & (n[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_ids_ptr, n, n_mask,
                                     visible, kv_head, d, d_mask, scale, soft_cap,
                                     stride_cb, stride_cs, stride_ch, BLOCK_SIZE, FP32_DOT, SOFT_CAP)
    if SINKS:  # the head's sink joins each row's denominator
        factor, l_i = _with_sink(m_i, l_i, tl.load(sinks_ptr + head).to(tl.float32))
        acc = acc * factor[:, None]
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a real row sees at least itself; a padding row may see nothing
    tl.store(out_ptr + m[:, None] * stride_ot + head * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & d_mask[None, :])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
                      context_len: int, scale: float, out: torch.Tensor,
                      block_m: int = PREFILL_BLOCK_M, block_n: int = PREFILL_BLOCK_N,
                      window: int | None = None, soft_cap: float | None = None,
                      sinks: torch.Tensor | None = None) -> None:
    """One chunk: q, out [n, H, D] at positions context_len - n .. context_len - 1 (their K/V already written);
    block_ids: the request's block table (long); window, soft_cap, sinks as decode_attention's."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    _prefill_kernel[(triton.cdiv(num_tokens, block_m), num_heads)](
        q, k_cache, v_cache, block_ids, out, out if sinks is None else sinks, scale, window or 0, soft_cap or 1.0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_tokens, context_len - num_tokens, head_dim, num_heads // num_kv_heads,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        # tl.dot needs every dimension >= 16
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), FP32_DOT=_fp32_dot(q.dtype),
        WINDOW=window is not None, SOFT_CAP=soft_cap is not None, SINKS=sinks is not None)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, window: int | None = None,
                    soft_cap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """AttentionBackend.forward's contract: q [T, H, D], k/v [T, KVH, D] (this step's new tokens), decode rows
    first. No host synchronisation: a decode-only step runs inside a CUDA graph."""
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    d = meta.num_decodes
    if d:
        decode_attention(q[:d], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale, out[:d],
                         window=window, soft_cap=soft_cap, sinks=sinks)
    for span in meta.prefills:
        sl = slice(span.start, span.start + span.num_tokens)
        prefill_attention(q[sl], k_cache, v_cache, span.block_ids, span.context_len, scale, out[sl],
                          window=window, soft_cap=soft_cap, sinks=sinks)
    return out


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True
    # a block table narrower than one split-K partition costs the decode kernel the same as one partition wide
    cuda_graph_min_width_tokens = DECODE_PARTITION

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        write_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None, logits_soft_cap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        return paged_attention(q, k, v, k_cache, v_cache, meta, scale, sliding_window, logits_soft_cap, sinks)

    def fused_ops(self, x: torch.Tensor) -> ModuleType | None:
        return triton_layer_ops if x.dtype in (torch.float32, torch.bfloat16, torch.float16) else None
