"""What names the custom ops carry on every backend, importable without Triton or TensorRT.

The ONNX functions' nodes carry `plugin_namespace` / `plugin_version`; TensorRT finds its plugin for
a node by these, so `tensorrt_plugins.py` registers under the same names.
"""

from specrt.plugins.tree_attention import PLUGIN_ATTRS

PLUGIN_NAMESPACE, PLUGIN_VERSION = PLUGIN_ATTRS["plugin_namespace"], PLUGIN_ATTRS["plugin_version"]
PLUGIN_OPS = ("TreeAttention", "RejectionSample")
DEFAULT_MAX_WINDOW = 64  # drafted nodes + root a TensorRT engine takes; bigger trees need `specrt build` again
TENSORRT_INSTALL_HINT = ("TensorRT is not installed: on a machine with an NVIDIA GPU and CUDA, "
                         "`pip install tensorrt polygraphy` (wheels come from NVIDIA's index via pypi.nvidia.com)")
