"""ONNX Runtime's device path (device KV, per-shape buffers, on-device compaction, CUDA graphs): `runner`."""
