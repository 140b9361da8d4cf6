"""Engines: one folder per backend, its build and its runner side by side.

    decoder.py     the `Decoder` protocol every runner implements
    registry.py    the backends by name (`open_decoder`, `make_decoder`)
    ort_cpu/       ONNX Runtime on the CPU (the default; always tested)
    ort_device/    ONNX Runtime's device path (CUDA provider, or the CPU provider for tests)
    trt/           TensorRT: build plan, build, runner, Polygraphy comparison

Engines import the schema (`specrt.schema`) and the plugins, never the runtime.
"""
