"""Deployment targets around a bundle: a Triton Inference Server model repository (triton/)."""
