"""ONNX Runtime on the CPU: `build` writes the ORT-optimized graphs, `runner` runs them with KV bound in place."""
