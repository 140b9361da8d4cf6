"""Custom ops shared by every backend (the floor of the dependency graph).

The decoder graph's attention and the acceptance rule are plain ONNX today; the portable custom
ops `specrt::TreeAttention` and `specrt::RejectionSample` (ONNX function body, NumPy reference,
Triton kernel, TensorRT plugin) are not implemented yet.
"""
