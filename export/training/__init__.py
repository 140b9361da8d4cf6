"""Self-distillation of drafters: the target writes the data, drafters learn to predict it."""
