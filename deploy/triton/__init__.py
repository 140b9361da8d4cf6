"""A Triton Inference Server model repository around the runtime: `repo` writes it, `model` is its model.py."""
