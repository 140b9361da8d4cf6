"""specrt: speculative decoding, exported to ONNX / TensorRT and served losslessly.

The import namespace is `specrt`; its subpackages live in the repository's top-level folders:
`specrt.export` (export/), `specrt.runtime` (runtime/), `specrt.plugins` (plugins/),
`specrt.engines` (engines/). Only `specrt.export` imports torch.
"""

__version__ = "0.1.0"
