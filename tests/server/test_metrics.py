"""/health, /metrics and /openapi.json."""

from __future__ import annotations

METRICS = [
    "streamer_http_requests_total",
    "streamer_prompt_tokens_total",
    "streamer_generated_tokens_total",
    "streamer_time_to_first_token_seconds_bucket",
    "streamer_inter_token_latency_seconds_bucket",
    "streamer_request_latency_seconds_bucket",
    "streamer_requests_running",
    "streamer_requests_waiting",
    "streamer_kv_pages_free",
    "streamer_kv_pages_used",
    "streamer_kv_pages_cached",
    "streamer_prefix_cache_hit_rate",
    "streamer_preemptions_total",
    "streamer_request_queue_time_seconds_bucket",
    "streamer_steps_held_total",
    "streamer_held_steps_joined_total",
    "streamer_held_steps_late_total",
    "streamer_device_busy_seconds_total",
    "streamer_device_idle_seconds_total",
]


def test_health(http):
    r = http.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok", "model": "smol"}


def test_metrics_names_and_values(http):
    http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
    text = http.get("/metrics").text
    for name in METRICS:
        assert f"\n{name}" in text, name
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values['streamer_http_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    assert values["streamer_generated_tokens_total"] >= 3
    assert values["streamer_time_to_first_token_seconds_count"] >= 1
    assert values["streamer_request_queue_time_seconds_count"] >= 1  # the wait for a first batch
    assert values["streamer_kv_pages_free"] + values["streamer_kv_pages_used"] == values["streamer_kv_pages_total"]


def test_openapi_document(http):
    doc = http.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= set(doc["paths"])
    schemas = doc["components"]["schemas"]
    ref = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    chat = schemas[ref["$ref"].rsplit("/", 1)[1]]
    assert "messages" in chat["required"] and "max_tokens" in chat["properties"]
    assert "400" in doc["paths"]["/v1/completions"]["post"]["responses"]


def test_chat_page_is_served(http):
    r = http.get("/")
    assert r.status_code == 200 and "/static/app.js" in r.text
    assert http.get("/static/app.js").status_code == 200


def test_requests_count_under_their_routes_template_and_unknown_paths_under_other(http):
    http.get("/v1/models/smol")
    http.get("/v1/responses/resp_nope")
    http.get("/no/such/path")
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in http.get("/metrics").text.splitlines()
              if line and not line.startswith("#")}
    assert values['streamer_http_requests_total{endpoint="/v1/models/{model:path}",status="200"}'] >= 1
    assert values['streamer_http_requests_total{endpoint="/v1/responses/{response_id}",status="404"}'] >= 1
    assert values['streamer_http_requests_total{endpoint="other",status="404"}'] >= 1
    assert not any("resp_nope" in k or "/no/such" in k for k in values)


def test_the_event_loop_histogram_renders_as_prometheus_client_does():
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from streamer.server.metrics import LATENCY_BUCKETS, LoopHistogram

    ours, theirs = CollectorRegistry(), CollectorRegistry()
    fast = LoopHistogram("x_seconds", "doc", LATENCY_BUCKETS, ours)
    ref = Histogram("x_seconds", "doc", buckets=LATENCY_BUCKETS, registry=theirs)
    for v, n in [(0.004, 1), (0.005, 3), (0.0051, 1), (0.2, 2), (31.0, 1), (0.0, 1)]:
        fast.observe(v, n)
        for _ in range(n):
            ref.observe(v)
    lines = lambda reg: sorted(  # noqa: E731 - (prometheus_client adds a _created sample)
        line for line in generate_latest(reg).decode().splitlines() if "_created" not in line
    )
    assert lines(ours) == lines(theirs)


def test_the_host_tier_is_in_metrics_when_it_is_on():
    from prometheus_client import CollectorRegistry, generate_latest

    from streamer.engine_stats import EngineStats, HostStats
    from streamer.server.metrics import EngineCollector

    def render(host):
        reg = CollectorRegistry()
        reg.register(EngineCollector(lambda: EngineStats(0, 0, 10, 10, 0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0.0, 0.0, 0,
                                                         host=host)))
        return generate_latest(reg).decode()

    assert "streamer_host_kv" not in render(None)
    text = render(HostStats(pages_total=100, pages_used=40, write_backs=50, load_backs=30, bytes_moved=8 << 20,
                            cached_tokens_total=480, hit_rate=0.25))
    for line in ("streamer_host_kv_pages_total 100.0", "streamer_host_kv_pages_used 40.0",
                 "streamer_host_kv_write_backs_total 50.0", "streamer_host_kv_load_backs_total 30.0",
                 "streamer_host_kv_bytes_moved_total 8.388608e+06", "streamer_host_cache_hit_rate 0.25",
                 "streamer_host_cached_prompt_tokens_total 480.0"):
        assert line in text, line
