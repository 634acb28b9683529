"""The OpenAI-compatible HTTP server over the engine, used by the judge flow and `sidecar serve`."""
