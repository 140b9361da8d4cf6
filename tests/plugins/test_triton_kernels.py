"""The Triton kernels (specrt.plugins.triton_kernels) equal the ops' NumPy references, run on CPU
tensors by Triton's interpreter, and compile ahead of time to PTX for sm_80 / sm_90 without a GPU."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton or the kernel modules are imported (conftest too)

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import zlib  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from specrt.errors import SpecrtError  # noqa: E402
from specrt.plugins import rejection_sample as rs  # noqa: E402
from specrt.plugins import tree_attention as ta  # noqa: E402
from specrt.runtime.acceptance import one_hot_rows  # noqa: E402
from specrt.runtime.sampling import SamplingParams, warp  # noqa: E402
from specrt.runtime.tree import Tree  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install triton; CI installs it with [dev])")

from specrt.plugins import triton_kernels  # noqa: E402
from specrt.plugins.triton_kernels.rejection_sample import rejection_sample  # noqa: E402
from specrt.plugins.triton_kernels.tree_attention import tree_attention  # noqa: E402

TREE = Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
TREES = {"single": Tree.chain(0), "chain": Tree.chain(4), "tree": TREE}


# ── TreeAttention ───────────────────────────────────────────────────────────────────────────────
def attention_case(seed, heads, kv_heads, tree: Tree, past: list[int], dim=8, dtype=torch.float32):
    rng = np.random.default_rng(seed)
    b_sz, t, cap = len(past), tree.size, max(past) + tree.size + 3
    q = torch.from_numpy(rng.normal(size=(b_sz, t, heads, dim)).astype(np.float32)).transpose(1, 2)  # a view
    k, v = (torch.from_numpy(rng.normal(size=(b_sz, kv_heads, cap, dim)).astype(np.float32)) for _ in "kv")
    mask = torch.from_numpy(np.broadcast_to(tree.mask, (b_sz, t, t)).copy())
    return q.to(dtype), k.to(dtype), v.to(dtype), torch.tensor(past, dtype=torch.int64), mask


def reference(q, k, v, past, mask):
    return ta.reference(*(x.float().numpy() if x.is_floating_point() else x.numpy() for x in (q, k, v, past, mask)))


@pytest.mark.parametrize("tree,heads,kv_heads,past,dim", [
    ("single", 4, 4, [0], 8), ("single", 6, 2, [40, 5], 8), ("chain", 4, 4, [0], 8), ("chain", 4, 2, [7], 12),
    ("chain", 6, 1, [3, 33], 8), ("tree", 4, 4, [0], 8), ("tree", 4, 2, [7], 8), ("tree", 6, 2, [3, 40], 8),
    ("tree", 3, 1, [64, 0], 16)])
def test_tree_attention_matches_reference(tree, heads, kv_heads, past, dim):
    """GQA groups 1/2/3/6, T = 1 and T > 1, branching masks, ragged past_len, several tiles, d padding."""
    case = attention_case(zlib.crc32(repr((tree, heads, past)).encode()), heads, kv_heads, TREES[tree], past, dim)
    got = tree_attention(*case)
    assert got.shape == case[0].shape and got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), reference(*case), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tree_attention_half_inputs(dtype):
    case = attention_case(3, 4, 2, TREE, [5, 36], dtype=dtype)
    got = tree_attention(*case)
    assert got.dtype == dtype
    np.testing.assert_allclose(got.float().numpy(), reference(*case), atol=2e-2 if dtype == torch.bfloat16 else 3e-3)


def test_tree_node_equals_plain_decoding_bitwise():
    """Each tree node's output is bitwise the output of decoding its token alone (T = 1) with its
    ancestors committed: the kernel reduces the same columns in the same tiles, in the same order."""
    heads, kv_heads, past = 4, 2, [30, 5]  # 30 + depth crosses the 32-column tile boundary
    q, k, v, pl, mask = attention_case(11, heads, kv_heads, TREE, past)
    tree_out = tree_attention(q, k, v, pl, mask)
    for b, p in enumerate(past):
        for t in range(TREE.size):
            ancestors = np.flatnonzero(TREE.mask[t])  # by depth, ending with t itself
            rows = np.concatenate([np.arange(p), p + ancestors])
            plain = tree_attention(q[b:b + 1, :, t:t + 1], k[b:b + 1, :, rows], v[b:b + 1, :, rows],
                                   torch.tensor([len(rows) - 1]), torch.ones((1, 1, 1), dtype=torch.bool))
            assert torch.equal(plain[0, :, 0], tree_out[b, :, t]), (b, t)


# ── RejectionSample ─────────────────────────────────────────────────────────────────────────────
RS_TREES = [Tree.chain(0), Tree.chain(1), Tree.chain(5), Tree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
            Tree.from_paths([[0], [1], [2], [3]])]
PARAMS = SamplingParams(temperature=0.9, top_k=6, top_p=0.95)


def rejection_cases(rng, tree: Tree, n: int, vocab: int, stochastic: bool):
    """n random windows: warped targets (with exact zeros), half the tokens drawn from the parent's
    target so that acceptances are common, q one-hot or a Dirichlet draw holding each token."""
    m = tree.size
    p = warp((2 * rng.normal(size=(n, m, vocab))).astype(np.float32), PARAMS)
    tokens = rng.integers(0, vocab, (n, m))
    for c in range(1, m):
        from_p = rng.random(n) < 0.5
        drawn = [rng.choice(vocab, p=row / row.sum()) for row in p[:, tree.parents[c]].astype(np.float64)]
        tokens[:, c] = np.where(from_p, drawn, tokens[:, c])
    if stochastic:
        q = rng.dirichlet(np.ones(vocab) * 0.5, size=(n, m)).astype(np.float32)
    else:
        q = np.stack([one_hot_rows(row, vocab) for row in tokens])
    u = rng.random((n, m), dtype=np.float32)
    return p, q, tokens, u


@pytest.mark.parametrize("tree", RS_TREES, ids=lambda t: f"{t.size}nodes")
@pytest.mark.parametrize("stochastic", [False, True])
def test_rejection_sample_matches_reference(tree, stochastic):
    rng = np.random.default_rng(tree.size * 2 + stochastic)
    n, vocab = 48, 10
    p, q, tokens, u = rejection_cases(rng, tree, n, vocab, stochastic)
    parents = torch.tensor([tree.parents] * n)
    draft = torch.from_numpy(q) if stochastic else None  # deterministic drafts: the kernel's implicit one-hot
    path, path_len, nxt = rejection_sample(torch.from_numpy(p), draft, torch.from_numpy(tokens), parents,
                                           torch.from_numpy(u))
    assert path.shape == (n, tree.size - 1)
    lengths = []
    for i in range(n):
        want = rs.rejection_sample_reference(p[i], q[i], tokens[i], tree.parents, u[i])
        got = path[i, : int(path_len[i])].tolist(), int(nxt[i])
        assert got == want, i
        assert (path[i, int(path_len[i]):] == -1).all()
        lengths.append(len(want[0]))
    if tree.size > 1:  # the cases exercise both outcomes
        assert 0 < np.mean(lengths) < tree.depth.max()


def test_rejection_sample_several_tiles_mixed_trees_and_unbatched():
    """Vocab 50 in 16-wide tiles (tail masked), two different trees of one size in one batch, fp16
    targets, and the unbatched form; dense one-hot q equals the implicit one."""
    rng = np.random.default_rng(5)
    trees = [Tree.chain(4), Tree.from_paths([[0], [1], [2], [3]])]
    vocab, n = 50, 12
    for stochastic in (False, True):
        cases = [rejection_cases(rng, tr, n, vocab, stochastic) for tr in trees]
        p, q, tokens, u = (np.concatenate(parts) for parts in zip(*cases, strict=True))
        p = p.astype(np.float16).astype(np.float32)
        parents = np.array([tr.parents for tr in trees for _ in range(n)])
        args = (torch.from_numpy(p).half(), torch.from_numpy(q), torch.from_numpy(tokens), torch.from_numpy(parents),
                torch.from_numpy(u))
        path, path_len, nxt = rejection_sample(*args, block_v=16)
        if not stochastic:
            implicit = rejection_sample(args[0], None, *args[2:], block_v=16)
            assert all(torch.equal(a, b) for a, b in zip((path, path_len, nxt), implicit, strict=True))
        for i in range(len(p)):
            want = rs.rejection_sample_reference(p[i], q[i], tokens[i], parents[i], u[i])
            assert (path[i, : int(path_len[i])].tolist(), int(nxt[i])) == want, (stochastic, i)
        one = rejection_sample(*(a[3] for a in args), block_v=16)
        assert (one[0][: int(one[1])].tolist(), int(one[2])) == (path[3, : int(path_len[3])].tolist(), int(nxt[3]))


def test_rejection_sample_all_zero_residual():
    """Rejecting the only token with mass leaves p all zero: nothing passes and the draw is V - 1."""
    p = torch.zeros(3, 4)
    p[:, 2] = 1.0
    # u · q(x) = 2 ≥ p(x) = 1: node 1 is rejected; node 2 (same token) then sees p(x) = 0
    args = (p, None, torch.tensor([0, 2, 2]), torch.tensor([-1, 0, 0]), torch.tensor([0.5, 2.0, 0.1]))
    path, path_len, nxt = rejection_sample(*args)
    assert (path_len.item(), nxt.item()) == (0, 3)
    assert rs.rejection_sample_reference(p.numpy(), one_hot_rows(np.array([0, 2, 2]), 4), [0, 2, 2], [-1, 0, 0],
                                         args[4].numpy()) == ([], 3)


# ── gating ──────────────────────────────────────────────────────────────────────────────────────
def test_without_triton_import_works_and_launch_says_how_to_install(monkeypatch):
    import specrt.plugins

    monkeypatch.setattr(specrt.plugins, "triton_kernels", triton_kernels)  # restored afterwards
    for name in [m for m in sys.modules if m.startswith("specrt.plugins.triton_kernels")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    monkeypatch.setitem(sys.modules, "triton.language", None)
    from specrt.plugins.triton_kernels.tree_attention import tree_attention as no_triton

    with pytest.raises(SpecrtError, match="pip install triton"):
        no_triton(*attention_case(0, 2, 2, Tree.chain(0), [0]))


def test_cpu_tensors_need_the_interpreter():
    with pytest.raises(SpecrtError, match="TRITON_INTERPRET=1"):
        triton_kernels.check_launch(object(), torch.zeros(1))


# ── ahead-of-time PTX ───────────────────────────────────────────────────────────────────────────
PTX_SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from specrt.plugins.triton_kernels.rejection_sample import rejection_sample_kernel
from specrt.plugins.triton_kernels.tree_attention import tree_attention_kernel

kernels = [
    (tree_attention_kernel, dict(q_ptr="*fp16", k_ptr="*fp16", v_ptr="*fp16", past_ptr="*i64", mask_ptr="*u8",
                                 out_ptr="*fp16"), dict(BLOCK_N=32, BLOCK_D=64, BLOCK_W=16)),
    (rejection_sample_kernel, dict(target_ptr="*fp32", draft_ptr="*fp32", tokens_ptr="*i64", parents_ptr="*i64",
                                   uniforms_ptr="*fp32", scratch_ptr="*fp32", path_ptr="*i64", path_len_ptr="*i64",
                                   next_ptr="*i64"), dict(ONE_HOT=False, BLOCK_V=1024)),
]
out = {}
for fn, pointers, constexprs in kernels:
    signature = {name: pointers.get(name, "constexpr" if name in constexprs else "i32") for name in fn.arg_names}
    for cap in (80, 90):
        src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        out[f"{fn.__name__}@{cap}"] = triton.compile(src, target=GPUTarget("cuda", cap, 32)).asm["ptx"]
json.dump(out, sys.stdout)
"""


def test_kernels_compile_to_ptx_for_sm80_and_sm90(tmp_path):
    """`triton.compile(ASTSource(...), target=GPUTarget("cuda", cap, 32))` needs no GPU or driver (LLVM
    and the bundled ptxas do the work). It runs in a child process: under TRITON_INTERPRET=1 the
    kernels are interpreter functions, not compilable JITFunctions."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", PTX_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ptx = json.loads(done.stdout)
    for kernel in ("tree_attention_kernel", "rejection_sample_kernel"):
        for cap in (80, 90):
            text = ptx[f"{kernel}@{cap}"]
            assert f".target sm_{cap}" in text  # sm_90 comes out as sm_90a (Hopper features)
            assert f".entry {kernel}(" in text
