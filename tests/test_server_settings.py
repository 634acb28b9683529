"""Server settings are checked at start, within finite bounds, and ``/health`` tells a dead batch worker."""

from __future__ import annotations

import socket

import httpx
import pytest
import uvicorn
from serving import chat, serving
from typer.testing import CliRunner

from cli.main import app as cli_app
from server.app import create_app
from server.config import ServerConfig
from sidecar import SidecarEngine


@pytest.mark.parametrize(("option", "value", "field"), [
    ("--batch-wait-ms", "inf", "batch_wait_ms"), ("--batch-wait-ms", "1e13", "batch_wait_ms"),
    ("--batch-wait-ms", "nan", "batch_wait_ms"), ("--batch-wait-ms", "-1", "batch_wait_ms"),
    ("--max-batch", "100000000", "max_batch"), ("--max-queue", "1000000000000", "max_queue"),
    ("--max-body-bytes", "1000000000000000", "max_body_bytes"), ("--prompt-cache-mib", "0", "prompt_cache_mib"),
    ("--prompt-cache-mib", "2000000", "prompt_cache_mib")])
def test_serve_refuses_a_setting_out_of_bounds_with_one_line_before_loading(option: str, value: str, field: str,
                                                                            monkeypatch) -> None:
    served: list[str] = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda server, sockets=None: served.append(server.config.host))
    result = CliRunner().invoke(cli_app, ["serve", "--pair", "tiny", option, value])
    assert result.exit_code == 2, result.output
    [line] = result.output.strip().splitlines()
    assert line.startswith("error: ") and field in line, line
    assert served == []


@pytest.mark.parametrize(("options", "mib"), [([], 256), (["--prompt-cache-mib", "64"], 64),
                                              (["--no-prompt-cache", "--prompt-cache-mib", "64"], None)])
def test_serve_sizes_or_turns_off_the_prompt_caches(options: list[str], mib: int | None, monkeypatch) -> None:
    """``--prompt-cache-mib`` bounds each model's prompt-scoring prefix cache, ``--no-prompt-cache`` keeps none."""
    apps: list = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda server, sockets=None: apps.append(server.config.app))
    result = CliRunner().invoke(cli_app, ["serve", "--pair", "tiny", *options])
    assert result.exit_code == 0, result.output
    service = apps[0].state.service
    service.close()  # the app never ran: its worker never started
    caches = {} if mib is None else {"target": mib << 20, "draft": mib << 20}
    assert {model: cache.max_bytes for model, cache in service.worker.prefix_caches.items()} == caches
    assert service.worker.stats.snapshot()["prompt_cache"].keys() == caches.keys()


@pytest.mark.servers
@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_serve_fails_at_once_on_a_taken_port_before_loading_the_models(host: str) -> None:
    """#41: the port is bound before the models load. The pair named here is unknown, which only loading finds
    out: the port's error, not the pair's, says that loading never began."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = CliRunner().invoke(cli_app, ["serve", "--pair", "no-such-pair", "--host", host, "--port", str(port)])
    assert result.exit_code == 2, result.output
    [line] = result.output.strip().splitlines()
    assert line.startswith("error: ") and f"{host}:{port}" in line and "address already in use" in line, line
    assert "--port" in line and "pair" not in line


@pytest.mark.servers
def test_health_is_503_with_its_reason_once_the_batch_worker_has_died(tiny) -> None:
    # a config that skipped validation, as every config could before it had bounds: the worker's wait overflows
    config = ServerConfig.model_construct(model_name="tiny", batch_wait_ms=float("inf"))
    with serving(create_app(SidecarEngine(tiny), config)) as (url, _):
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        first = httpx.post(url + "/v1/chat/completions", json=chat("hi", max_tokens=4), timeout=60)
        health = httpx.get(url + "/health", timeout=10)
        later = httpx.post(url + "/v1/chat/completions", json=chat("hi", max_tokens=4), timeout=10)
    assert first.status_code == 503 and later.status_code == 503, (first.text, later.text)
    assert later.json()["error"]["code"] == "worker_failed"
    assert health.status_code == 503
    body = health.json()
    assert body["status"] == "unhealthy" and "worker" in body["reason"] and "OverflowError" in body["reason"], body
