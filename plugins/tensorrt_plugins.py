"""TensorRT plugins for specrt's custom ops, as quickly deployable plugins (`tensorrt.plugin`).

NEVER RUN in this workplace (no TensorRT, no GPU): written against TensorRT's documented
`tensorrt.plugin` API (register / aot_impl / impl, KernelLaunchParams, SymInt32) and unverified
until someone runs `specrt build --backend trt` on a GPU machine.

How an engine picks these up: the exported graphs call `specrt::TreeAttention` as an ONNX local
function whose node carries `plugin_namespace="specrt"`, `plugin_version="1"`. With the plugins
registered before parsing, TensorRT's ONNX parser (≥ 10.7) prefers a registered plugin over the
function body, and `build_trt` also sets `OnnxParserFlag.ENABLE_PLUGIN_OVERRIDE` (≥ 10.15).

- `specrt::TreeAttention`: ahead-of-time implementation. The Triton kernel of
  specrt.plugins.triton_kernels.tree_attention is compiled to PTX at build time and embedded in the
  engine, so the engine runs (and is captured in CUDA graphs) without calling back into Python. An
  AOT kernel takes (input pointers, int32 scalars, output pointers), so `_tree_attention_aot` is a
  thin Triton wrapper in that order around the existing kernel body. BLOCK_W (the window, a
  constexpr of the kernel) is fixed to the engine's max window, given to `register_plugins`.
  Open risk, checked only on a GPU: Triton ≥ 3.3 appends two hidden pointer parameters
  (global / profile scratch) to every kernel's PTX; TensorRT's AOT launch passes only inputs,
  scalars and outputs. `compile_tree_attention` refuses kernels that need global scratch, but
  whether TensorRT tolerates the unused trailing parameters is unverified.
- `specrt::RejectionSample`: Python (JIT) implementation calling the Triton launcher on TensorRT's
  stream. Not AOT: the kernel needs an fp32 scratch row and a -1 pre-filled `path`, which a single
  AOT launch cannot provide. Its `path` output is [M-1] padded with -1 (the kernel's layout), where
  the ONNX function body's is [A]: consumers stop at the first -1 (or read `path_len`-many entries).
  It is not part of any decoder engine (acceptance runs on ONNX Runtime); it is registered so a
  standalone RejectionSample model can be built.
"""

import dataclasses
import functools

from specrt.errors import SpecrtError
from specrt.plugins.plugin_names import DEFAULT_MAX_WINDOW, PLUGIN_NAMESPACE, TENSORRT_INSTALL_HINT
from specrt.plugins.triton_kernels import INSTALL_HINT as TRITON_HINT
from specrt.plugins.triton_kernels import tl  # None without triton; Triton's codegen looks `tl` up here

INSTALL_HINT = TENSORRT_INSTALL_HINT

TREE_ATTENTION = f"{PLUGIN_NAMESPACE}::TreeAttention"
REJECTION_SAMPLE = f"{PLUGIN_NAMESPACE}::RejectionSample"



@dataclasses.dataclass
class _Registration:
    """TensorRT's plugin registry is one per process and refuses a second registration of a name, so
    what this process registered is process state too: whether it did, and the widest window any
    engine of this process asked for (the AOT kernel's BLOCK_W, read when an engine is built)."""

    registered: bool = False
    max_window: int = 0


REGISTRATION = _Registration()


def _require_plugin_api():
    """(tensorrt, tensorrt.plugin), or SpecrtError naming what to install."""
    try:
        import tensorrt as trt
        import tensorrt.plugin as trtp
    except ImportError:
        raise SpecrtError(INSTALL_HINT) from None
    return trt, trtp


def register_plugins(max_window: int = DEFAULT_MAX_WINDOW) -> None:
    """Register both plugins with TensorRT (once per process); later calls may only raise max_window."""
    trt, trtp = _require_plugin_api()
    REGISTRATION.max_window = max(int(max_window), REGISTRATION.max_window)
    if REGISTRATION.registered:
        return
    _define(trt, trtp)
    REGISTRATION.registered = True


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


# Scalar parameters of the AOT wrapper, in order (all int32): what `tree_attention_aot` passes as extra args.
TREE_ATTENTION_SCALARS = ("T", "D", "HEADS", "GROUPS", "sq_b", "sq_h", "sq_t", "sk_b", "sk_h", "sk_s",
                          "sv_b", "sv_h", "sv_s", "sm_b", "sm_t", "so_b", "so_h", "so_t")


@functools.cache
def tree_attention_aot_kernel():
    """TreeAttention in the AOT plugin's argument order (inputs, int32 scalars, output), wrapping the
    existing kernel. Built on first use: importing this module needs neither torch nor TensorRT."""
    import triton

    from specrt.plugins.triton_kernels.tree_attention import tree_attention_kernel

    @triton.jit
    def tree_attention_aot(q_ptr, k_ptr, v_ptr, past_ptr, mask_ptr,
                           T, D, HEADS, GROUPS,
                           sq_b, sq_h, sq_t, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sm_b, sm_t, so_b, so_h, so_t,
                           out_ptr,
                           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr):
        tree_attention_kernel(q_ptr, k_ptr, v_ptr, past_ptr, mask_ptr, out_ptr, T, D, HEADS, GROUPS,
                              sq_b, sq_h, sq_t, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sm_b, sm_t, so_b, so_h, so_t,
                              BLOCK_N, BLOCK_D, BLOCK_W)

    return tree_attention_aot


def compile_tree_attention(dtype: str, past_dtype: str, head_dim: int, max_window: int, target=None):
    """Compile the AOT wrapper with Triton (dtype: fp32 / fp16 / bf16; past_dtype: i64 / i32).

    `target` (a triton GPUTarget) lets this run without a GPU, as the tests do. Refuses a kernel
    that needs Triton's global scratch buffer: the AOT launch passes no such pointer.
    """
    try:
        import triton
    except ImportError:
        raise SpecrtError(f"the TensorRT TreeAttention plugin needs triton: {TRITON_HINT}") from None
    from specrt.plugins.triton_kernels.tree_attention import BLOCK_N, NUM_WARPS

    signature = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "past_ptr": f"*{past_dtype}",
                 "mask_ptr": "*u8", **{n: "i32" for n in TREE_ATTENTION_SCALARS}, "out_ptr": f"*{dtype}",
                 "BLOCK_N": "constexpr", "BLOCK_D": "constexpr", "BLOCK_W": "constexpr"}
    constants = {"BLOCK_N": BLOCK_N, "BLOCK_D": _pow2(head_dim), "BLOCK_W": _pow2(max_window)}
    src = triton.compiler.ASTSource(fn=tree_attention_aot_kernel(), signature=signature, constexprs=constants)
    compiled = triton.compile(src, target=target, options={"num_warps": NUM_WARPS})
    if getattr(compiled.metadata, "global_scratch_size", 0):
        raise SpecrtError("the TreeAttention kernel now needs Triton global scratch memory, which a TensorRT "
                          "AOT plugin launch does not provide")
    return compiled


def _define(trt, trtp) -> None:  # pragma: no cover - needs TensorRT
    """The plugin definitions; the decorators register them with TensorRT as they run."""

    @trtp.register(TREE_ATTENTION)
    def tree_attention_desc(q: trtp.TensorDesc, k_cache: trtp.TensorDesc, v_cache: trtp.TensorDesc,
                            past_len: trtp.TensorDesc, tree_mask: trtp.TensorDesc,
                            num_heads: int, num_kv_heads: int, head_dim: int) -> trtp.TensorDesc:
        return q.like()  # [B, H, T, d] in q's dtype

    @trtp.aot_impl(TREE_ATTENTION)
    def tree_attention_aot(q: trtp.TensorDesc, k_cache: trtp.TensorDesc, v_cache: trtp.TensorDesc,
                           past_len: trtp.TensorDesc, tree_mask: trtp.TensorDesc,
                           num_heads: int, num_kv_heads: int, head_dim: int,
                           outputs: tuple[trtp.TensorDesc], tactic: int):
        b, h, t, d = q.shape_expr  # contiguous (LINEAR) tensors: strides follow from the shapes
        kv, s = k_cache.shape_expr[1], k_cache.shape_expr[2]
        scalars = [t, head_dim, num_heads, num_heads // num_kv_heads,
                   h * t * d, t * d, d,  # q
                   kv * s * d, s * d, d,  # k
                   kv * s * d, s * d, d,  # v
                   t * t, t,  # tree_mask [B, T, T], one byte per entry
                   h * t * d, t * d, d]  # out
        dtypes = {trt.float32: "fp32", trt.float16: "fp16", trt.bfloat16: "bf16"}
        compiled = compile_tree_attention(dtypes[q.dtype], {trt.int64: "i64", trt.int32: "i32"}[past_len.dtype],
                                          head_dim, REGISTRATION.max_window)
        launch = trtp.KernelLaunchParams()
        launch.grid_x = t  # one program per (window row, batch × head), as the Triton launcher
        launch.grid_y = b * h
        launch.block_x = compiled.metadata.num_warps * 32
        launch.shared_mem = compiled.metadata.shared
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in scalars])
        return compiled.metadata.name.encode(), compiled.asm["ptx"].encode(), launch, extra

    @trtp.register(REJECTION_SAMPLE)
    def rejection_sample_desc(target_probs: trtp.TensorDesc, draft_probs: trtp.TensorDesc,
                              tokens: trtp.TensorDesc, parents: trtp.TensorDesc, ranks: trtp.TensorDesc,
                              tree_mask: trtp.TensorDesc, uniforms: trtp.TensorDesc
                              ) -> tuple[trtp.TensorDesc, trtp.TensorDesc]:
        m = target_probs.shape_expr[0]
        path = trtp.from_shape_expr((m - 1,), dtype=trt.int64)  # padded with -1 (see module docstring)
        next_token = trtp.from_shape_expr((), dtype=trt.int64)
        return path, next_token

    @trtp.impl(REJECTION_SAMPLE)
    def rejection_sample_impl(target_probs: trtp.Tensor, draft_probs: trtp.Tensor, tokens: trtp.Tensor,
                              parents: trtp.Tensor, ranks: trtp.Tensor, tree_mask: trtp.Tensor,
                              uniforms: trtp.Tensor, outputs: tuple[trtp.Tensor], stream: int) -> None:
        import torch

        from specrt.plugins.triton_kernels.rejection_sample import rejection_sample

        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            t = [torch.as_tensor(x, device="cuda") for x in (target_probs, draft_probs, tokens, parents, uniforms)]
            path, _, next_token = rejection_sample(*t)
            torch.as_tensor(outputs[0], device="cuda").copy_(path)
            torch.as_tensor(outputs[1], device="cuda").copy_(next_token)
