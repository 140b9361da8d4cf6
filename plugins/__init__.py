"""Custom ops shared by every backend (the floor of the dependency graph).

`specrt::TreeAttention`, `specrt::RejectionSample` and `specrt::GreedyAccept`: ONNX local functions
(standard ops only, so ONNX Runtime runs them) with NumPy references beside them; Triton kernels for
the first two in `triton_kernels/` (tested on the CPU interpreter and compiled to PTX here; never run
on a GPU in this workplace). TensorRT plugins for TreeAttention and RejectionSample:
`tensorrt_plugins.py` (registered by `specrt build --backend trt` and the TensorRT runner).
"""
