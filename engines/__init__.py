"""Engines: backend-specific artifacts built from a bundle's ONNX graphs, recorded in its manifest."""
