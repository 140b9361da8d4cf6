"""Serving: the continuous-batching engine, the OpenAI-compatible HTTP API and its metrics."""
