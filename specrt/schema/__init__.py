"""The bundle's schema: `manifest.json` and the decoder config it records (torch-free; the floor every
layer may import)."""
