"""Export: load Hugging Face / GGUF weights into compact torch modules and write ONNX bundles.

This is the only part of specrt that imports torch and transformers.
"""
