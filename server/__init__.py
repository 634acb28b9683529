"""The OpenAI-compatible HTTP server over the engine, used by the judge flow and ``sidecar serve``.

Modules, bottom to top: ``config`` (ServerConfig; imports nothing heavy), ``errors``, ``schema`` (the
requests: every OpenAI field declared, each honoured or refused by name in ``refusal``), ``stream`` (token
ids to text), ``worker`` (the thread that runs the continuous batch), ``service`` (requests to jobs,
results to responses), ``app`` (the FastAPI app), ``launcher`` (``serve`` and ``running_server``).
"""
