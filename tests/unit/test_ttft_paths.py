"""The TTFT-by-path probe (benchmarks/ttft_paths.py): reading Ray Serve's HAProxy files and building prompts."""

import json
import random

import pytest

from kvtide.benchmarks.ttft_paths import describe, direct_mode_ports, request_body, round_order

LUA = '''local ROUTERS = {
    ["http-kvtide"] = { { host = "127.0.0.1", port = 30000, host_header = "127.0.0.1:30000" } }
}'''
CFG = '''backend http-kvtide
    server SERVE_REPLICA_kvtide-Engine-w63nl5zo 127.0.0.1:30001 check observe layer4 error-limit 3
    server SERVE_PROXY_ACTOR-fallback-c3c4 127.0.0.1:8500 check backup'''


def test_ports_come_from_the_lua_router_pool_and_the_first_engine_replica_server():
    """The routing peer's port is the Lua pool's, the replica's the first SERVE_REPLICA server line (not the proxy fallback)."""
    assert direct_mode_ports(LUA, CFG) == (30000, 30001)


def test_files_without_a_peer_or_replica_are_refused_with_a_hint():
    """An ingress-mode or half-written config raises ValueError naming direct mode, not an IndexError later."""
    with pytest.raises(ValueError, match="direct mode"):
        direct_mode_ports("local ROUTERS = {}", CFG)
    with pytest.raises(ValueError, match="direct mode"):
        direct_mode_ports(LUA, "backend http-kvtide\n")


def test_prompts_differ_from_their_first_token_and_ask_for_token_ids():
    """Each prompt starts with its serial (no prefix-cache hit between rounds) and streams token ids."""
    rng = random.Random(0)
    first, second = (json.loads(request_body(rng, "m", serial)) for serial in (0, 1))
    assert first["prompt"].split()[0] == "0" and second["prompt"].split()[0] == "1"
    assert first["stream"] and first["return_token_ids"] and first["model"] == "m"


def test_describe_reports_milliseconds_by_rank():
    """describe gives n, p50, p25, p75 and min in milliseconds."""
    assert describe([0.010, 0.020, 0.030, 0.040]) == "n=4 p50 25.0 ms, p25 20.0, p75 40.0, min 10.0"


def test_rounds_alternate_whether_the_full_path_goes_first_and_consult_precedes_replica():
    """Even rounds measure the full path first, odd rounds last; the consult always comes just before the replica request."""
    assert round_order(0) == ("full", "consult", "replica")
    assert round_order(1) == ("consult", "replica", "full")
    assert round_order(-5) == round_order(1)


def test_each_kvtide_round_also_times_a_short_consult_after_its_paths(monkeypatch):
    """A kvtide round measures full, consult and replica, then a 5-word consult; warm-up rounds are not kept."""
    import json

    import kvtide.benchmarks.ttft_paths as tp

    calls: list[tuple[str, int]] = []

    def consult(port, body):
        calls.append(("consult", len(json.loads(body)["prompt"].split()) - 1))  # minus the serial number
        return 0.002, {"x": "y"}

    def first_token(port, body, headers=None):
        calls.append(("replica" if headers else "full", port))
        return 0.030

    monkeypatch.setattr(tp, "latest_haproxy_files", lambda: ("", ""))
    monkeypatch.setattr(tp, "direct_mode_ports", lambda lua, cfg: (30000, 30001))
    monkeypatch.setattr(tp, "consult_s", consult)
    monkeypatch.setattr(tp, "first_token_s", first_token)
    paths = tp.measure_paths("kvtide", 8000, "m", rounds=3, words=480)
    assert {path: len(v) for path, v in paths.items()} == {
        "full": 3, "consult": 3, "replica": 3, "consult-short": 3, "full - replica": 3}
    assert calls[-4:] == [("full", 8000), ("consult", 480), ("replica", 30001), ("consult", 5)]  # round 2: full first
    assert len(calls) == 4 * (5 + 3)


def test_consult_batches_pair_long_and_short_fresh_prompts(monkeypatch):
    """Each batch times its long prompts, then as many 5-word ones, every prompt with a serial of its own."""
    import json

    import kvtide.benchmarks.ttft_paths as tp

    sent: list[tuple[int, int]] = []

    def consult(port, body):
        serial, *words = json.loads(body)["prompt"].split()
        sent.append((int(serial), len(words)))
        return 0.001, {}

    monkeypatch.setattr(tp, "latest_haproxy_files", lambda: ("", ""))
    monkeypatch.setattr(tp, "direct_mode_ports", lambda lua, cfg: (30000, 30001))
    monkeypatch.setattr(tp, "consult_s", consult)
    batches = tp.consult_batches("m", batches=2, per_batch=3, words=40)
    assert [(len(b["long"]), len(b["short"])) for b in batches] == [(3, 3), (3, 3)]
    assert [n for _, n in sent] == [40, 40, 40, 5, 5, 5] * 2
    assert len({serial for serial, _ in sent}) == 12
