"""Serving: the continuous-batching scheduler, the OpenAI-compatible HTTP API and its metrics."""
