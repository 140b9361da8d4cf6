"""specrt: speculative decoding, exported to ONNX / TensorRT and served losslessly.

The import namespace is `specrt`; its subpackages live in the repository's top-level folders:
`specrt.schema` (specrt/schema/), `specrt.engines` (engines/, one folder per backend),
`specrt.runtime` (runtime/), `specrt.export` (export/), `specrt.plugins` (plugins/),
`specrt.tools` (tools/) and `specrt.cli` (specrt/cli/). Only `specrt.export` imports torch.
"""

__version__ = "0.1.0"
