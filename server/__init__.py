"""The OpenAI-compatible HTTP server over the engine, used by the judge flow and ``sidecar serve``.

Modules, bottom to top: ``config`` (ServerConfig; imports nothing heavy), ``errors``, ``schema``,
``stream`` (token ids to text), ``worker`` (the thread that runs the continuous batch), ``service``
(requests to jobs, results to responses), ``app`` (the FastAPI app), ``launcher`` (``serve`` and
``running_server``).
"""
