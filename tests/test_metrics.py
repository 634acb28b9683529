"""``GET /metrics`` on a real server with the tiny pair, read with prometheus_client's own parser."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving import chat, serving

from server.app import create_app
from server.config import ServerConfig
from sidecar import HASHTAGS, SidecarEngine

TAGS = {"name": "hashtags", "instruction": HASHTAGS.instruction, "max_tokens": 8, "parser": "hashtags"}


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics`` by (name, sorted labels)."""
    response = httpx.get(url + "/metrics", timeout=60)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def streamed_usage(url: str, body: dict) -> dict:
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        chunks = [json.loads(line.removeprefix("data: ")) for line in response.iter_lines()
                  if line.startswith("data: {")]
    return chunks[-1]["usage"]


def leave_mid_stream(url: str) -> None:
    body = chat("The city council approved a new budget on Tuesday.", max_tokens=1000, stream=True)
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and json.loads(line.removeprefix("data: "))["choices"][0]["delta"].get(
                    "content"):
                return  # leaving the block closes the connection mid-stream


@pytest.mark.servers
def test_metrics_count_what_concurrent_clients_sent(tiny) -> None:
    app = create_app(SidecarEngine(tiny), ServerConfig(model_name="tiny", max_batch=8, batch_wait_ms=200))
    with serving(app) as (url, _), ThreadPoolExecutor(5) as pool:
        endpoint = url + "/v1/chat/completions"
        assert scrape(url)[("sidecar:requests_total", (("outcome", "ok"),))] == 0  # present before any request
        plain = pool.submit(httpx.post, endpoint, json=chat("Prices rose 3.5 percent in 2017.", max_tokens=12),
                            timeout=300)
        tagged = pool.submit(httpx.post, endpoint, timeout=300, json=chat(
            "The president met leaders in Berlin, Moscow and Doha.", max_tokens=10) | {"sidecars": [TAGS]})
        streamed = pool.submit(streamed_usage, url, chat("The team won its third game in a row.", max_tokens=9,
                                                         stream=True, stream_options={"include_usage": True}))
        invalid = pool.submit(httpx.post, endpoint, json=chat("hi", temperature=-1), timeout=300)
        left = pool.submit(leave_mid_stream, url)
        assert invalid.result().status_code == 400
        answers = [plain.result().json(), tagged.result().json()]
        usages = [a["usage"] for a in answers] + [streamed.result()]
        left.result()
        deadline = time.monotonic() + 60  # the server notices the client that left at its next step
        while (metrics := scrape(url))[("sidecar:requests_total", (("outcome", "cancelled"),))] < 1:
            assert time.monotonic() < deadline, "the request whose client left was never counted"
            time.sleep(0.1)
        # answered after a step that dropped the row whose client left: the worker is idle from then on
        after = httpx.post(endpoint, json=chat("hi", max_tokens=4), timeout=300).json()
        usages.append(after["usage"])
        metrics = scrape(url)
        stats = httpx.get(url + "/stats", timeout=60).json()

    def value(name: str, **labels: str) -> float:
        return metrics[(name, tuple(sorted(labels.items())))]

    outcomes = {o: value("sidecar:requests_total", outcome=o) for o in ("ok", "4xx", "5xx", "cancelled")}
    assert outcomes == {"ok": 4, "4xx": 1, "5xx": 0, "cancelled": 1}
    assert sum(v for (name, _), v in metrics.items() if name == "sidecar:request_success_total") == 4
    for histogram in ("e2e_request_latency", "time_to_first_token"):
        assert value(f"sidecar:{histogram}_seconds_count") == 4
        assert value(f"sidecar:{histogram}_seconds_sum") > 0
    assert value("sidecar:time_per_output_token_seconds_count") == sum(u["completion_tokens"] > 1 for u in usages)
    assert value("sidecar:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert value("sidecar:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert value("sidecar:spec_decode_num_draft_tokens_total") == sum(u["drafted_tokens"] for u in usages)
    assert value("sidecar:spec_decode_num_accepted_tokens_total") == sum(u["accepted_tokens"] for u in usages)
    assert value("sidecar:spec_decode_num_draft_tokens_total") > 0
    assert 4 <= value("sidecar:spec_decode_num_target_forwards_total") <= value("sidecar:generation_tokens_total")
    assert value("sidecar:sidecar_generation_tokens_total", sidecar="hashtags") == (
        answers[1]["sidecars"]["hashtags"]["usage"]["completion_tokens"]) > 0
    # the worker's totals are those of /stats
    assert value("sidecar:batch_steps_total") == stats["steps"]
    assert value("sidecar:batch_step_requests_total") == sum(int(n) * c for n, c in stats["step_sizes"].items())
    assert value("sidecar:cancelled_tokens_total") == stats["cancelled_tokens"] > 0
    assert value("sidecar:batch_slots") == 8 and value("sidecar:num_requests_running") == 0
    device = stats["device"]
    assert value("sidecar:device_forwards_total") == device["forwards"] > 0
    assert value("sidecar:device_measured_seconds_total") == device["measured_seconds"]
    assert {dict(labels)["phase"]: v for (name, labels), v in metrics.items()
            if name == "sidecar:device_charged_seconds_total"} == device["charged_seconds_by_phase"]
    # the capture counters are those of /stats, the faults among them present at 0
    capture = stats["capture"]
    assert value("sidecar:capture_mode_info", mode=capture["mode"]) == 1
    for model, counters in capture["counters"].items():
        for key in ("forwards", "graph_calls", "compiles", "recompiles", "graph_breaks", "cudagraph_skips"):
            assert value(f"sidecar:capture_{key}_total", model=model) == counters[key], (model, key)
        assert counters["forwards"] > 0 and counters["recompiles"] == counters["graph_breaks"] == 0
    assert set(capture["counters"]) == {"target", "draft"}
    assert value("sidecar:step_syncs_total") == capture["steps"]["syncs"] > 0
    assert value("sidecar:step_host_seconds_total") == pytest.approx(
        capture["steps"]["step_seconds"] - capture["steps"]["read_seconds"], abs=1e-5)


def test_each_app_has_its_own_registry(tiny) -> None:
    engine = SidecarEngine(tiny)
    first, second = (create_app(engine, ServerConfig(model_name="tiny")) for _ in range(2))
    first.state.metrics.refused(400)
    assert first.state.metrics.registry.get_sample_value("sidecar:requests_total", {"outcome": "4xx"}) == 1
    assert second.state.metrics.registry.get_sample_value("sidecar:requests_total", {"outcome": "4xx"}) == 0
