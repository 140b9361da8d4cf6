"""Triton kernel for `specrt::TreeAttention` (see specrt.plugins.tree_attention for the op).

    q [B, H, T, d] (already scaled), k_cache / v_cache [B, KV, S, d] holding the window's own rows at
    past_len .. past_len+T-1, past_len [B], tree_mask [B, T, T] bool (ancestor-or-self)
    → out [B, H, T, d] in q's dtype; fp16 / bf16 / fp32 inputs, fp32 arithmetic throughout.

One program per (window row t, batch b, query head h); query head h reads KV head h // (H / KV) by
index (K/V are never repeated). The program runs an online softmax over the row's *visible columns
in a fixed order*: the committed prefix 0 .. past_len-1, then the row's ancestors-or-self by depth.
Window nodes are ordered parents-before-children (depth-sorted), so "by depth" is increasing window
index u: the k-th visible window column is the k-th set bit of tree_mask[b, t].

Those visible columns are treated as one virtual sequence of length past_len + depth(t), cut into
BLOCK_N tiles from position 0. A tree node's tiles therefore hold exactly the numbers, in exactly
the places, that a chain holding only its ancestors, or plain decoding of that token (T = 1 with the
ancestors committed), has in its tiles: the reductions run in the same order and a tree node's
output is bitwise the chain / plain output (same kernel, same d, same device). This mirrors the
column permutation of the ONNX function body. It is also why a program handles one row: tiles of
several rows would mix per-row gathers and make a row's reduction layout depend on its neighbours.
Rows that see nothing (past_len 0, empty mask row) output 0.
"""

from __future__ import annotations

import torch

from specrt.plugins.triton_kernels import check_launch, jit, tl, triton

BLOCK_N = 32  # columns per tile; fixed (not tuned per shape) so results never depend on the launch
NUM_WARPS = 4


@jit
def _attend_tile(q, k_base, v_base, stride_ks, stride_vs, rows, valid, d, d_ok, m_i, l_i, acc):
    """One online-softmax step over the cache rows `rows` (masked by `valid`); fp32 state."""
    ld_mask = valid[:, None] & d_ok[None, :]
    k = tl.load(k_base + rows[:, None] * stride_ks + d[None, :], mask=ld_mask, other=0.0).to(tl.float32)
    s = tl.where(valid, tl.sum(q[None, :] * k, 1), float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new)
    v = tl.load(v_base + rows[:, None] * stride_vs + d[None, :], mask=ld_mask, other=0.0).to(tl.float32)
    return m_new, l_i * alpha + tl.sum(p, 0), acc * alpha + tl.sum(p[:, None] * v, 0)


@jit
def tree_attention_kernel(q_ptr, k_ptr, v_ptr, past_ptr, mask_ptr, out_ptr,
                          T, D, HEADS, GROUPS,
                          sq_b, sq_h, sq_t, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sm_b, sm_t, so_b, so_h, so_t,
                          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr):
    """out[b, h, t] = softmax over the visible columns of q[b, h, t] · k[b, h // GROUPS]ᵀ, times v.

    Grid (T, B * H). Last dims contiguous; tree_mask as uint8; past_len int32 or int64.
    """
    t = tl.program_id(0)
    b = tl.program_id(1) // HEADS
    h = tl.program_id(1) % HEADS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + b * sq_b + h * sq_h + t * sq_t + d, mask=d_ok, other=0.0).to(tl.float32)
    k_base = k_ptr + b * sk_b + (h // GROUPS) * sk_h
    v_base = v_ptr + b * sv_b + (h // GROUPS) * sv_h
    past = tl.load(past_ptr + b).to(tl.int32)
    # the row's visible window columns and each one's place among them (= its depth - 1)
    w = tl.arange(0, BLOCK_W)
    seen = tl.load(mask_ptr + b * sm_b + t * sm_t + w, mask=w < T, other=0) != 0
    place = tl.cumsum(seen.to(tl.int32), 0) - 1
    n = past + tl.sum(seen.to(tl.int32), 0)  # length of the virtual sequence

    m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), 0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    full = (past // BLOCK_N) * BLOCK_N
    for start in range(0, full, BLOCK_N):  # tiles wholly inside the prefix: cache row = position
        i = start + tl.arange(0, BLOCK_N)
        m_i, l_i, acc = _attend_tile(q, k_base, v_base, sk_s, sv_s, i, i < n, d, d_ok, m_i, l_i, acc)
    for start in range(full, n, BLOCK_N):  # the rest: the prefix's tail, then the ancestors by depth
        i = start + tl.arange(0, BLOCK_N)
        hit = seen[None, :] & (place[None, :] == (i - past)[:, None])  # [BLOCK_N, BLOCK_W]
        u = tl.sum(tl.where(hit, w[None, :], 0), 1)
        rows = tl.where(i < past, i, past + u)
        m_i, l_i, acc = _attend_tile(q, k_base, v_base, sk_s, sv_s, rows, i < n, d, d_ok, m_i, l_i, acc)
    out = acc / tl.maximum(l_i, 1e-30)
    tl.store(out_ptr + b * so_b + h * so_h + t * so_t + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, past_len: torch.Tensor,
                   tree_mask: torch.Tensor) -> torch.Tensor:
    """Launch the kernel: shapes as in the module docstring; returns a new [B, H, T, d] tensor."""
    check_launch(tree_attention_kernel, q, k_cache, v_cache, past_len, tree_mask)
    b_sz, heads, t, dim = q.shape
    kv_heads = k_cache.shape[1]
    if (k_cache.shape != v_cache.shape or k_cache.shape[0] != b_sz or k_cache.shape[3] != dim
            or heads % kv_heads or tuple(tree_mask.shape) != (b_sz, t, t) or tuple(past_len.shape) != (b_sz,)):
        raise ValueError(f"TreeAttention shapes disagree: q {tuple(q.shape)}, k/v {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)}, past_len {tuple(past_len.shape)}, tree_mask {tuple(tree_mask.shape)}")
    q, k_cache, v_cache = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k_cache, v_cache))
    mask = tree_mask.to(torch.bool).contiguous().view(torch.uint8)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    tree_attention_kernel[(t, b_sz * heads)](
        q, k_cache, v_cache, past_len.contiguous(), mask, out,
        t, dim, heads, heads // kv_heads,
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], *mask.stride()[:2], *out.stride()[:3],
        BLOCK_N=BLOCK_N, BLOCK_D=triton.next_power_of_2(dim), BLOCK_W=triton.next_power_of_2(t),
        num_warps=NUM_WARPS)
    return out
