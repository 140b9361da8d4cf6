"""TensorRT: `profiles` plans the build (pure, tested), `build` makes the plans, `runner` runs them,
`polygraphy_check` compares them with ONNX Runtime. TensorRT's imports are gated everywhere."""
