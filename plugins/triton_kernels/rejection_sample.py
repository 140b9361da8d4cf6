"""Triton kernel for `specrt::RejectionSample` (see specrt.plugins.rejection_sample for the op).

    target_probs [B, M, V], draft_probs [B, M, V] (row c: the q that node c's token was drawn from;
    row 0 unused) or None for deterministic drafts (q_c one-hot at tokens[c], never materialised),
    tokens [B, M], parents [B, M] (parents[0] = -1), uniforms [B, M] (uniforms[c] tests node c,
    uniforms[0] draws the final token); the leading B may be left out.
    → path [B, M-1] int64 (accepted window nodes by depth, root excluded, padded with -1),
      path_len [B] int64, next_token [B] int64.

One program per batch row walks the tree sequentially, exactly as rejection_sample_reference:
from the root, each child c of the current node (in window order = sibling-rank order) is accepted
when u_c · q_c(x) < p(x); on acceptance p becomes target_probs[c], on rejection
p ← max(p − q_c, 0) / max(Σ, 1e-30); when no child is accepted the token is the inverse-CDF draw
`min(#{i : cdf_i ≤ u_0 · cdf_V}, V − 1)` from p. Window nodes must be ordered parents-before-children
(parents[c] < c; specrt's trees are depth-sorted): then one forward scan over c visits every child
of the current node in rank order after the node itself was accepted, so the walk needs no stack.

The running distribution p lives in an fp32 scratch row [V] in global memory, swept in BLOCK_V
tiles (the vocabulary does not fit in registers); barriers order its writes before the reads of
other threads. Ranks and tree_mask, inputs of the ONNX op, are not needed here. Sums run per tile,
so p can differ from NumPy's pairwise sums in the last bit: a decision can flip only when u lands
within an ulp of a threshold.
"""

from __future__ import annotations

import torch

from specrt.plugins.triton_kernels import check_launch, jit, tl, triton

BLOCK_V = 1024  # vocabulary tile (at most; smaller vocabularies take the next power of two)
NUM_WARPS = 4


@jit
def _load_row(src, dst, V, BLOCK_V: tl.constexpr):
    """dst[:V] = float32(src[:V])."""
    tl.debug_barrier()  # every thread has read what it needed from dst
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < V, other=0.0).to(tl.float32), mask=offs < V)
    tl.debug_barrier()


@jit
def _reject(res, q_row, x, V, ONE_HOT: tl.constexpr, BLOCK_V: tl.constexpr):
    """res ← max(res − q, 0) / max(Σ, 1e-30), q = q_row or one-hot at x (an all-zero residual stays 0)."""
    tl.debug_barrier()  # every thread has read what it needed from res
    total = tl.sum(tl.zeros([BLOCK_V], tl.float32), 0)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        if ONE_HOT:
            q = (offs == x).to(tl.float32)
        else:
            q = tl.load(q_row + offs, mask=offs < V, other=0.0).to(tl.float32)
        r = tl.maximum(tl.load(res + offs, mask=offs < V, other=0.0) - q, 0.0)
        tl.store(res + offs, r, mask=offs < V)
        total += tl.sum(r, 0)
    total = tl.maximum(total, 1e-30)
    tl.debug_barrier()
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        tl.store(res + offs, tl.math.div_rn(tl.load(res + offs, mask=offs < V, other=0.0), total), mask=offs < V)
    tl.debug_barrier()


@jit
def _sample(res, u, V, BLOCK_V: tl.constexpr):
    """min(#{i : cdf_i ≤ u · cdf_V}, V − 1): the inverse-CDF draw from res[:V]."""
    total = tl.sum(tl.zeros([BLOCK_V], tl.float32), 0)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        total += tl.sum(tl.load(res + offs, mask=offs < V, other=0.0), 0)
    threshold = u * total
    carry = tl.sum(tl.zeros([BLOCK_V], tl.float32), 0)
    count = tl.sum(tl.zeros([BLOCK_V], tl.int32), 0)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        p = tl.load(res + offs, mask=offs < V, other=0.0)
        cdf = carry + tl.cumsum(p, 0)
        count += tl.sum(((cdf <= threshold) & (offs < V)).to(tl.int32), 0)
        carry += tl.sum(p, 0)
    return tl.minimum(count, V - 1)


@jit
def rejection_sample_kernel(target_ptr, draft_ptr, tokens_ptr, parents_ptr, uniforms_ptr, scratch_ptr,
                            path_ptr, path_len_ptr, next_ptr, M, V,
                            st_b, st_m, sd_b, sd_m, stok_b, spar_b, su_b, spath_b,
                            ONE_HOT: tl.constexpr, BLOCK_V: tl.constexpr):
    """Sequential tree rejection sampling for batch row program_id(0); grid (B,).

    Rows of target / draft have contiguous vocab; scratch is [B, V] fp32; path pre-filled with -1.
    """
    b = tl.program_id(0)
    res = scratch_ptr + b * V
    _load_row(target_ptr + b * st_b, res, V, BLOCK_V)
    node = tl.program_id(0) * 0  # int32 scalars
    count = node
    for c in range(1, M):
        if tl.load(parents_ptr + b * spar_b + c).to(tl.int32) == node:
            x = tl.load(tokens_ptr + b * stok_b + c).to(tl.int32)
            if ONE_HOT:
                q_x = 1.0
            else:
                q_x = tl.load(draft_ptr + b * sd_b + c * sd_m + x).to(tl.float32)
            u = tl.load(uniforms_ptr + b * su_b + c).to(tl.float32)
            if u * q_x < tl.load(res + x):
                tl.store(path_ptr + b * spath_b + count, c)
                count += 1
                node = c
                _load_row(target_ptr + b * st_b + c * st_m, res, V, BLOCK_V)
            else:
                _reject(res, draft_ptr + b * sd_b + c * sd_m, x, V, ONE_HOT, BLOCK_V)
    u0 = tl.load(uniforms_ptr + b * su_b).to(tl.float32)
    tl.store(path_len_ptr + b, count.to(tl.int64))
    tl.store(next_ptr + b, _sample(res, u0, V, BLOCK_V).to(tl.int64))


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, tokens: torch.Tensor,
                     parents: torch.Tensor, uniforms: torch.Tensor, *, block_v: int = BLOCK_V
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the kernel: shapes as in the module docstring; returns (path, path_len, next_token).

    block_v (a power of two) caps the vocabulary tile; tests lower it to exercise several tiles.
    """
    batched = target_probs.dim() == 3
    if not batched:
        target_probs, tokens, parents, uniforms = (x.unsqueeze(0) for x in (target_probs, tokens, parents, uniforms))
        draft_probs = None if draft_probs is None else draft_probs.unsqueeze(0)
    check_launch(rejection_sample_kernel, target_probs, tokens, parents, uniforms,
                 *([] if draft_probs is None else [draft_probs]))
    b_sz, m, v = target_probs.shape
    if (tokens.shape != (b_sz, m) or parents.shape != (b_sz, m) or uniforms.shape != (b_sz, m)
            or (draft_probs is not None and draft_probs.shape != target_probs.shape)):
        raise ValueError(f"RejectionSample shapes disagree: target {tuple(target_probs.shape)}, draft "
                         f"{None if draft_probs is None else tuple(draft_probs.shape)}, tokens {tuple(tokens.shape)}, "
                         f"parents {tuple(parents.shape)}, uniforms {tuple(uniforms.shape)}")
    target_probs = target_probs if target_probs.stride(-1) == 1 else target_probs.contiguous()
    draft = target_probs if draft_probs is None else draft_probs  # unread when one-hot
    draft = draft if draft.stride(-1) == 1 else draft.contiguous()
    tokens, parents, uniforms = tokens.contiguous(), parents.contiguous(), uniforms.contiguous()
    dev = target_probs.device
    scratch = torch.empty((b_sz, v), dtype=torch.float32, device=dev)
    path = torch.full((b_sz, max(m - 1, 1)), -1, dtype=torch.int64, device=dev)
    path_len = torch.empty(b_sz, dtype=torch.int64, device=dev)
    next_token = torch.empty(b_sz, dtype=torch.int64, device=dev)
    rejection_sample_kernel[(b_sz,)](
        target_probs, draft, tokens, parents, uniforms, scratch, path, path_len, next_token, m, v,
        target_probs.stride(0), target_probs.stride(1), draft.stride(0), draft.stride(1),
        tokens.stride(0), parents.stride(0), uniforms.stride(0), path.stride(0),
        ONE_HOT=draft_probs is None, BLOCK_V=min(block_v, triton.next_power_of_2(v)), num_warps=NUM_WARPS)
    path = path[:, : m - 1]
    return (path, path_len, next_token) if batched else (path[0], path_len[0], next_token[0])
