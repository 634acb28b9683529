"""The OpenAI-compatible HTTP server over the engine: a user of the library, used by the judge flow and `sidecar serve`."""
