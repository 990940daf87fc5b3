"""Every dashboard query and alert signal returns data from a real Prometheus scraping a real cluster.

A real Prometheus (Debian's /usr/bin/prometheus) scrapes the cluster's Ray metrics port
every second and loads the generated rule file. The test drives OpenAI traffic on the
session's app (completions and chat, streamed and not, client errors, a shared prefix for
prefix-cache hits, two requests one after the other on one prefix so the router's predicted
hit is one the engine confirms, a tools chat the routing peer renders with vLLM's renderer,
a client that hangs up mid-stream) and on a "pressure" app
of its own whose shape produces the series light traffic never does:

    pressure app   autoscaling on (min = max = 1): the KV policy decides every tick
                   KV cache of ~680 tokens, 4 admitted at once: 8 concurrent 400-token
                   requests preempt (vLLM reclaims blocks) and get 429s (admission)
                   engine replica killed after hot-prefix traffic: its replacement
                   warm-starts (the warm-up prefill counter)

It waits until Prometheus holds all of it, then:

- evaluates every panel query (Grafana variables set to "All", $__rate_interval 2m) and
  every alert rule's condition-FREE `signal` through /api/v1/query: each must return a
  series with a finite value. The full `expr` is the signal plus a threshold that a
  healthy cluster does not cross, so it is the signal that proves the names and labels
  exist; promtool (tests/unit/test_alerts.py) proves the thresholds.
- checks Prometheus loaded and evaluated every rule without error;
- checks the catalog against the scrape: every `ray_kvtide_*` series is catalogued, and
  every catalog entry is scraped (each entry's `needs` is met by the traffic above);
- checks the KV tiers' series: on CPU no CPU tier runs, yet every running engine replica has
  each of them, the CPU tier's at zero, and its GPU-tier hit tokens equal vLLM's own count;
- renders one PNG per dashboard from range queries into dashboards/previews/.
"""

from __future__ import annotations

import concurrent.futures
import math
import random
import re
import time
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest

import ray
from ray import serve
from support import (Prom, ThreadClients, deploy_app, engine_actor_names, finite, metric_sum, metric_values, running_engines,
                     running_prometheus, wait_for)

from kvtide.dashboards import alerts, build
from kvtide.dashboards.catalog import CATALOG, series_names
from kvtide.dashboards.promql import Selectors, resolve_grafana_vars

PREVIEWS = build.REPO_ROOT / "dashboards" / "previews"
PRESSURE_APP = "kvtide-pressure"
PRESSURE_GATE = 4  # requests the pressure app's ingress admits at once


@pytest.fixture(scope="module")
def prometheus(cluster, tmp_path_factory) -> Prom:
    target = urlparse(cluster.metrics_url)
    scrape = (f"  - job_name: kvtide\n    metrics_path: {target.path}\n"
              f"    static_configs: [{{targets: ['{target.netloc}']}}]\n")
    with running_prometheus(tmp_path_factory.mktemp("prometheus"), scrape, [alerts.RULES_FILE]) as prom:
        yield prom


@pytest.fixture(scope="module")
def pressure_app(cluster, cluster_config):
    deploy_app(cluster_config, PRESSURE_APP, [
        "replicas.num_replicas=null", "replicas.min_replicas=1", "replicas.max_replicas=1",
        "autoscaling.metrics_push_interval_s=1", "autoscaling.look_back_s=2", "frontend.num_replicas=1",
        "engine.max_model_len=512",
        # 2 MiB of KV: 6 layers x 2 (K, V) x 2 heads x 64 dims x 2 bytes = 3 KiB per token, ~680 tokens.
        "engine.kv_cache_memory_bytes=2097152",
        f"frontend.admission.max_ongoing_requests={PRESSURE_GATE}"])
    try:
        yield cluster.base_url + f"/{PRESSURE_APP}"
    finally:
        serve.delete(PRESSURE_APP)


ENGINE_GAUGES = ("ray_vllm_kv_cache_usage_perc", "ray_vllm_num_requests_running", "ray_vllm_num_requests_waiting")


def _pressure_gauges_exported(metrics_url: str) -> bool:
    return all(metric_values(metrics_url, name, model_name=PRESSURE_APP) for name in ENGINE_GAUGES)


def _drive_pressure(url: str, metrics_url: str) -> None:
    """A warm-started replacement replica, then preemptions and 429s on it (the pressure app)."""
    # vLLM's gauges exist as soon as a replica is ready, before any request.
    wait_for(lambda: _pressure_gauges_exported(metrics_url), 30, 1.0, "the idle pressure engine's gauges")
    hot = " ".join(["shared system prompt"] * 60)  # 185 tokens: 5 full blocks shared by every request
    with ThreadClients(base_url=url, timeout=300) as http:
        for i in range(4):
            assert http.post("/v1/completions", json={"model": PRESSURE_APP, "prompt": f"{hot} q{i}",
                                                      "max_tokens": 1}).status_code == 200
        # The replacement of a killed replica asks the ingress for its hot prefixes and prefills
        # them. Killed first, so every series below lives in the replica that stays.
        (victim,) = engine_actor_names(PRESSURE_APP)
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        wait_for(lambda: engine_actor_names(PRESSURE_APP) not in ([], [victim])
                 and running_engines(PRESSURE_APP) == 1, 300, 1.0, "the killed pressure replica's replacement")
        wait_for(lambda: metric_sum(metrics_url, "ray_kvtide_engine_warmup_prefill_tokens_total",
                                    model=PRESSURE_APP) > 0, 60, 1.0, "the replacement's warm-up prefill")
        # Twice the gate at once, each needing ~400 of the cache's ~680 tokens: the admitted ones
        # outgrow the cache while decoding (preemption); the others arrive while the gate is full
        # (each admitted request runs 400 forced decode steps) and get 429.
        body = {"model": PRESSURE_APP, "max_tokens": 400, "ignore_eos": True, "temperature": 0}

        def burst() -> list[int]:
            with concurrent.futures.ThreadPoolExecutor(2 * PRESSURE_GATE) as pool:
                return list(pool.map(lambda i: http.post("/v1/completions", json={**body, "prompt": f"pressure {i}"})
                                     .status_code, range(2 * PRESSURE_GATE)))

        statuses = burst()
        assert sorted(statuses) == [200] * PRESSURE_GATE + [429] * PRESSURE_GATE, statuses
        # The PinnedAtMax alert's signal needs one "bounds" decision: the law asking for more than
        # max_replicas while the pressure lasts. A burst lasts as long as 400 decode steps take, so
        # on a fast engine a controller tick can miss it: hold the pressure, burst after burst,
        # until the decision is exported.
        deadline_s = time.monotonic() + 180
        while metric_sum(metrics_url, "ray_kvtide_autoscaler_decisions_total", reason="bounds") == 0:
            assert time.monotonic() < deadline_s, "no autoscaler 'bounds' decision under KV pressure in 180 s"
            burst()


def _drive_traffic(cluster) -> int:
    """OpenAI traffic exercising every ingress/engine metric; returns the number of finished requests."""
    rng = random.Random(5)
    shared = [rng.randrange(100, 8000) for _ in range(256)]  # 8 blocks of 32 tokens, shared by many prompts
    url, model = cluster.base_url, cluster.model_name
    sent = 0

    def post(path: str, body: dict[str, Any]) -> httpx.Response:
        with httpx.Client(base_url=url, timeout=300) as http:
            return http.post(path, json=body)

    jobs: list[tuple[str, dict[str, Any], int]] = []
    for i in range(12):  # shared prefix → prefix-cache hits on both replicas
        jobs.append(("/v1/completions", {"model": model, "prompt": shared + [rng.randrange(100, 8000)
                                                                             for _ in range(16)],
                                         "max_tokens": 8}, 200))
    for i in range(6):  # streamed completions and chats → inter-token latency
        jobs.append(("/v1/completions", {"model": model, "prompt": f"def f{i}(x):", "max_tokens": 24,
                                         "stream": True}, 200))
        jobs.append(("/v1/chat/completions", {"model": model, "max_tokens": 16, "stream": i % 2 == 0,
                                              "messages": [{"role": "user", "content": f"hello {i}"}]}, 200))
    for i in range(8):  # longer prompts, concurrently → running/waiting and KV usage move
        jobs.append(("/v1/completions", {"model": model, "prompt": [rng.randrange(100, 8000) for _ in range(1500)],
                                         "max_tokens": 32}, 200))
    jobs += [  # client errors: 404 unknown model, 400 context too long
        ("/v1/completions", {"model": "nope", "prompt": "x"}, 404),
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "x"}],
                                  "max_tokens": 100000}, 400),
    ]
    with concurrent.futures.ThreadPoolExecutor(max_workers=12) as pool:
        futures = [(pool.submit(post, path, body), status) for path, body, status in jobs]
        for future, status in futures:
            assert future.result().status_code == status
            sent += 1
    # One prefix, twice in a row on an idle fleet: the second request's predicted hit (the router
    # routed the first there) is confirmed by the engine, so every round has a true_hit and the
    # index precision/recall queries a non-zero denominator (a burst's predictions can all be
    # false hits, made before the first prefill finished).
    pair_prefix = [rng.randrange(100, 8000) for _ in range(128)]  # 4 blocks of 32
    for i in range(2):
        assert post("/v1/completions", {"model": model, "prompt": pair_prefix + [100 + i] * 8,
                                        "max_tokens": 4}).status_code == 200
        sent += 1
    # A tools chat, answered by vLLM's layer, until one reaches it rendered by the routing peer (the session runs
    # with serving.peer_renders_chat; the peer builds vLLM's renderer in the background): the reuse counter.
    tools_chat = {"model": model, "max_tokens": 2, "tool_choice": "none", "messages": [{"role": "user", "content": "hi"}],
                  "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    chats = []

    def handed_over() -> bool:
        assert post("/v1/chat/completions", tools_chat).status_code == 200
        chats.append(1)
        return metric_sum(cluster.metrics_url, "ray_kvtide_vllm_prompts_reused_total") > 0

    wait_for(handed_over, 180, 1.0, "a chat the routing peer rendered with vLLM's renderer")
    sent += len(chats)
    # A client that hangs up mid-stream: the engine aborts the request (aborted counter, status 499).
    with httpx.Client(base_url=url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={"model": model, "prompt": "import", "max_tokens": 2000,
                                                          "stream": True, "ignore_eos": True}) as resp:
            for _ in resp.iter_lines():
                break
    return sent


def test_dashboards_and_alerts_return_data_from_a_real_prometheus(cluster, prometheus, pressure_app) -> None:
    """Every panel query and alert signal has data; the catalog equals the scrape; previews are drawn."""
    started_s = time.time()
    # Prometheus must be scraping before the traffic, or it sees only flat counters (rate 0).
    wait_for(lambda: "ray_serve_deployment_replica_healthy" in prometheus.names(), 120, 1.0, "the first scrape")
    _drive_pressure(pressure_app, cluster.metrics_url)
    sent = _drive_traffic(cluster)
    # vLLM creates its gauges at an engine's first request (this test may be the session's first).
    wait_for(lambda: "ray_vllm_num_requests_running" in prometheus.names(), 120, 1.0, "the engines' gauges")
    wait_for(lambda: finite(prometheus.query("sum(ray_kvtide_requests_total)"))
             and float(prometheus.query("sum(ray_kvtide_requests_total)")[0]["value"][1]) >= sent,
             120, 1.0, f"Prometheus to hold all {sent} finished requests")
    wait_for(lambda: "ray_kvtide_engine_aborted_requests_total" in prometheus.names(), 60, 1.0,
             "the engine's abort counter")

    for name in ("ray_vllm_num_preemptions_total", "ray_kvtide_admission_rejections_total",
                 "ray_kvtide_autoscaler_decisions_total", "ray_kvtide_engine_warmup_prefill_tokens_total"):
        wait_for(lambda: name in prometheus.names(), 60, 1.0, f"the pressure app's {name}")

    # --- every panel query and alert signal returns a finite value ----------------------------
    checks: list[tuple[str, str]] = []
    for spec in build.dashboard_specs():
        for panel in spec.panels():
            checks += [(f"{spec.uid} / {panel.title}", resolve_grafana_vars(q.expr)) for q in panel.queries]
        for var in spec.variables:
            if var.name == "namespace":
                continue  # the label exists only under Kubernetes' PodMonitor
            selector, label = re.fullmatch(r"label_values\((.*), (\w+)\)", var.query).groups()
            checks.append((f"{spec.uid} / variable {var.name}",
                           resolve_grafana_vars(f"count by ({label}) ({selector})")))
    for rule in alerts.rules(Selectors()):
        checks.append((f"alert {rule.name} signal", rule.signal))

    def missing() -> list[str]:
        return [f"{title}: {expr}" for title, expr in checks if not finite(prometheus.query(expr))]

    failures: list[str] = []
    for round_left in (2, 1, 0):
        try:
            wait_for(lambda: not missing(), 60, 2.0, "every query to return data")
            break
        except AssertionError:
            if not round_left:
                failures += ["no finite data: " + line for line in missing()]
            else:  # rate() windows need recent samples: on a slow host a sampled series can age out of them
                _drive_traffic(cluster)

    # --- Prometheus loaded and evaluated every generated rule ------------------------------------
    groups = prometheus.http.get("/api/v1/rules").json()["data"]["groups"]
    loaded = {r["name"]: r for g in groups for r in g["rules"]}
    assert set(loaded) == {r.name for r in alerts.rules(Selectors())}
    failures += [f"rule {name}: {r.get('lastError')}" for name, r in loaded.items() if r.get("health") == "err"]

    # --- the catalog equals the scrape ---------------------------------------------------------
    scraped = prometheus.names()
    known = series_names()
    failures += [f"uncatalogued kvtide series in the scrape: {name}" for name in sorted(scraped)
                 if name.startswith("ray_kvtide_") and name not in known]
    for entry in CATALOG:
        if not set(entry.series) <= scraped:
            failures.append(f"catalogued but not scraped: {entry.name}")

    failures += _kv_tier_failures(prometheus)

    # More traffic rounds before drawing, so the previews show curves rather than a point or two.
    for _ in range(4):
        _drive_traffic(cluster)
    _render_previews(prometheus, started_s, time.time())
    # The pressure app has been idle since its burst, longer than Ray keeps a series no one
    # sets (~20 s): its engine's gauges are still exported.
    assert _pressure_gauges_exported(cluster.metrics_url), "an idle engine's gauges went missing"
    assert not failures, "\n".join(failures)


# Per engine replica, each KV-tier series a running replica exports from its start (ReplicaId: vLLM's label and value).
TIER_SERIES = ('ray_kvtide_engine_cached_blocks{tier="gpu"}', 'ray_kvtide_engine_cached_blocks{tier="cpu"}',
               'ray_kvtide_engine_prefix_hit_tokens_total{tier="gpu"}',
               'ray_kvtide_engine_prefix_hit_tokens_total{tier="cpu"}',
               'ray_kvtide_engine_kv_transfer_bytes_total{direction="offload"}',
               'ray_kvtide_engine_kv_transfer_bytes_total{direction="onload"}',
               "ray_kvtide_engine_onload_tokens_per_second")
# On CPU vLLM cannot offload (engine.kv_offload is refused there): these stay at zero.
CPU_TIER_ZERO = ('ray_kvtide_engine_cached_blocks{tier="cpu"}', 'ray_kvtide_engine_prefix_hit_tokens_total{tier="cpu"}',
                 "ray_kvtide_engine_kv_transfer_bytes_total", "ray_kvtide_engine_onload_tokens_per_second",
                 'ray_kvtide_router_matched_tokens_total{tier="cpu"}')
# The shared-prefix traffic hits the GPU tier: these have counted something.
GPU_TIER_DATA = ('ray_kvtide_engine_cached_blocks{tier="gpu"}', 'ray_kvtide_engine_prefix_hit_tokens_total{tier="gpu"}',
                 'ray_kvtide_router_matched_tokens_total{tier="gpu"}')


def _replica_ids(prom: Prom, expr: str) -> set[str]:
    return {series["metric"].get("ReplicaId", "") for series in prom.query(expr)}


def _gpu_hits_by_replica(prom: Prom, name: str) -> dict[str, float]:
    """Running replicas' GPU prefix-hit tokens from `name` (kvtide's tier counter or vLLM's own), those with any:
    vLLM's counter appears at its first hit, kvtide's at zero."""
    running = _replica_ids(prom, "ray_vllm_num_requests_running")
    selector = f'{name}{{tier="gpu"}}' if name.startswith("ray_kvtide_") else name
    return {series["metric"]["ReplicaId"]: float(series["value"][1])
            for series in prom.query(f"sum by (ReplicaId) ({selector})")
            if series["metric"]["ReplicaId"] in running and float(series["value"][1]) > 0}


def _kv_tier_failures(prom: Prom) -> list[str]:
    """Every running replica has every KV-tier series; the CPU tier's read 0 here, the GPU tier's count the traffic."""
    failures = []

    def every_replica_has_every_series() -> bool:
        running = _replica_ids(prom, "ray_vllm_num_requests_running")
        return bool(running) and all(running <= _replica_ids(prom, expr) for expr in TIER_SERIES)

    try:
        wait_for(every_replica_has_every_series, 60, 1.0, "every running engine replica's KV-tier series")
    except AssertionError as exc:
        failures.append(str(exc))
    for expr in CPU_TIER_ZERO:
        result = prom.query(f"max({expr})")
        if not finite(result) or float(result[0]["value"][1]) != 0.0:
            failures.append(f"CPU tier not at zero on a CPU cluster: {expr} = {result}")
    for expr in GPU_TIER_DATA:
        result = prom.query(f"sum({expr})")
        if not finite(result) or float(result[0]["value"][1]) <= 0.0:
            failures.append(f"no GPU-tier data after shared-prefix traffic: {expr} = {result}")
    # The tier counter follows the stat logger within one export period (the fleet is idle now).
    try:
        wait_for(lambda: _gpu_hits_by_replica(prom, "ray_kvtide_engine_prefix_hit_tokens_total")
                 == _gpu_hits_by_replica(prom, "ray_vllm_prefix_cache_hits_total"), 60, 1.0,
                 "kvtide's GPU-tier hit tokens to equal vLLM's prefix_cache_hits per replica")
    except AssertionError as exc:
        failures.append(str(exc))
    return failures


def _render_previews(prom: Prom, start: float, end: float) -> None:
    """One PNG per dashboard: its key panels, drawn from range queries over the test's traffic."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    PREVIEWS.mkdir(parents=True, exist_ok=True)
    step_s = max(1.0, (end - start) / 200)
    for spec in build.dashboard_specs():
        panels = [p for p in spec.panels() if p.preview][:6]
        cols = 3
        rows = math.ceil(len(panels) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(15, 3.4 * rows), squeeze=False)
        for ax, panel in zip(axes.flat, panels):
            for query in panel.queries:
                for series in prom.query_range(resolve_grafana_vars(query.expr), start, end, step_s):
                    points = [(float(t) - start, float(v)) for t, v in series["values"] if math.isfinite(float(v))]
                    if points:
                        label = _legend(query.legend, series["metric"])
                        # Markers: a short test window may give a series only a few points.
                        ax.plot(*zip(*points), label=label, linewidth=1.2, marker="o", markersize=2.5)
            ax.set_title(panel.title, fontsize=10)
            ax.set_xlabel("s", fontsize=8)
            ax.set_ylabel(panel.unit, fontsize=8)
            ax.tick_params(labelsize=7)
            if ax.lines:
                ax.legend(fontsize=6, loc="upper left")
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        fig.suptitle(f"{spec.title} — local CPU demo cluster", fontsize=12)
        fig.tight_layout()
        fig.savefig(PREVIEWS / f"{spec.uid}.png", dpi=80)
        plt.close(fig)


def _legend(template: str, labels: dict[str, str]) -> str:
    text = template or ",".join(f"{k}={v}" for k, v in labels.items() if k != "__name__") or "value"
    for key, value in labels.items():
        text = text.replace("{{" + key + "}}", value[:10])
    return text
