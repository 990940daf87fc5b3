"""Admission control's pure logic: limits derived from the fleet, the gate, deadlines, prompt limits."""

from __future__ import annotations

import pytest

from kvtide.config import ConfigError, parse_config
from kvtide.deployments.frontend.admission import (
    AdmissionGate,
    Deadline,
    admission_limits,
    engine_replicas_for_capacity,
    max_prompt_chars,
)


def _config(**sections):
    return parse_config(sections)


@pytest.mark.parametrize(("sections", "ongoing", "per_handle"), [
    # 2 engines x 32 seqs = 64 slots, + 64 queued (default: one batch per engine), over 1 ingress
    ({"engine": {"max_num_seqs": 32}, "replicas": {"num_replicas": 2}}, 128, 64),
    # the same fleet split over 2 ingress replicas
    ({"engine": {"max_num_seqs": 32}, "replicas": {"num_replicas": 2}, "frontend": {"num_replicas": 2}}, 64, 32),
    # an explicit fleet queue; odd totals round up so the fleet is never under-admitted
    ({"engine": {"max_num_seqs": 4}, "replicas": {"num_replicas": 1},
      "frontend": {"num_replicas": 3, "admission": {"max_queued_requests": 3}}}, 3, 1),
    # autoscaling sizes for the ceiling: the gate must not starve a scaled-up fleet
    ({"engine": {"max_num_seqs": 8}, "replicas": {"min_replicas": 1, "max_replicas": 4}}, 64, 32),
    # a queue of 0: only batch slots are admitted; the handle queue keeps a floor of 1
    ({"engine": {"max_num_seqs": 8}, "replicas": {"num_replicas": 1},
      "frontend": {"admission": {"max_queued_requests": 0}}}, 8, 1),
])
def test_ingress_mode_limits_follow_the_engine_fleet(sections, ongoing, per_handle):
    """Ingress mode: null limits are (engine replicas x max_num_seqs + queue) / ingress replicas, rounded up."""
    limits = admission_limits(_config(http={"mode": "ingress"}, **sections))
    assert limits.max_ongoing_requests == ongoing
    assert limits.max_queued_requests_per_handle == per_handle


@pytest.mark.parametrize(("sections", "ongoing"), [
    # each of 2 engines admits its batch of 32 plus its half of the 64-request fleet queue
    ({"engine": {"max_num_seqs": 32}, "replicas": {"num_replicas": 2}}, 64),
    # ingress replicas do not exist in direct mode: the count is ignored
    ({"engine": {"max_num_seqs": 32}, "replicas": {"num_replicas": 2}, "frontend": {"num_replicas": 4}}, 64),
    # an explicit queue of 3 over 2 engines rounds up to 2 each
    ({"engine": {"max_num_seqs": 4}, "replicas": {"num_replicas": 2},
      "frontend": {"admission": {"max_queued_requests": 3}}}, 6),
])
def test_direct_mode_gate_is_per_engine_replica(sections, ongoing):
    """Direct mode: every engine replica gates its own HTTP traffic at max_num_seqs + its share of the queue."""
    assert admission_limits(_config(**sections)).max_ongoing_requests == ongoing


def test_explicit_limit_wins():
    """A configured max_ongoing_requests is used as is."""
    limits = admission_limits(_config(ingress={"admission": {"max_ongoing_requests": 7}}))
    assert limits.max_ongoing_requests == 7


def test_engine_replicas_for_capacity_uses_the_fixed_count_or_the_ceiling():
    """Fixed replicas count as given; autoscaling counts max_replicas; zero counts as one."""
    assert engine_replicas_for_capacity(_config(replicas={"num_replicas": 3})) == 3
    assert engine_replicas_for_capacity(_config(replicas={"min_replicas": 0, "max_replicas": 5})) == 5
    assert engine_replicas_for_capacity(_config(replicas={"num_replicas": 0})) == 1


def test_timeout_retry_after_and_retries_pass_through():
    """The deadline, Retry-After and retry count come from frontend.admission."""
    limits = admission_limits(_config(ingress={"admission": {
        "request_timeout_s": 30, "retry_after_s": 5, "max_retries": 0}}))
    assert (limits.request_timeout_s, limits.retry_after_s, limits.max_retries) == (30, 5, 0)
    assert admission_limits(_config(ingress={"admission": {"request_timeout_s": None}})).request_timeout_s is None


@pytest.mark.parametrize(("sections", "fragment"), [
    ({"frontend": {"admission": {"max_ongoing_requests": 0}}}, "frontend.admission.max_ongoing_requests: got 0"),
    ({"frontend": {"admission": {"request_timeout_s": -1}}}, "frontend.admission.request_timeout_s: got -1"),
    ({"frontend": {"admission": {"max_queue": 3}}}, "did you mean 'max_queued_requests'"),
    ({"frontend": {"max_messages": 0}}, "frontend.max_messages: got 0"),
])
def test_bad_admission_config_names_field_and_value(sections, fragment):
    """Invalid admission settings fail naming the field and the value."""
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        parse_config(sections)


def test_gate_admits_up_to_its_limit_then_refuses():
    """The gate refuses at once past its limit (no parking) and admits again after a release."""
    gate = AdmissionGate(2)
    assert gate.try_enter() and gate.try_enter()
    assert not gate.try_enter()
    assert (gate.num_ongoing, gate.num_rejected) == (2, 1)
    gate.leave()
    assert gate.try_enter()
    assert gate.num_ongoing == 2


def test_gate_rejects_unbalanced_leave_and_zero_limit():
    """A release without an admission is a bug, and so is a gate that admits nothing."""
    with pytest.raises(RuntimeError):
        AdmissionGate(1).leave()
    with pytest.raises(ValueError):
        AdmissionGate(0)


def test_deadline_counts_down_on_the_injected_clock():
    """remaining_s shrinks with the given time and never goes negative; no timeout means None."""
    deadline = Deadline(10.0, now_s=100.0)
    assert deadline.remaining_s(100.0) == 10.0
    assert deadline.remaining_s(107.5) == 2.5
    assert deadline.remaining_s(200.0) == 0.0
    assert Deadline(None, now_s=100.0).remaining_s(1e9) is None


def test_prompt_char_limit_defaults_to_16_chars_per_context_token():
    """null max_prompt_chars is 16 x max_model_len; a configured one wins."""
    assert max_prompt_chars(_config(engine={"max_model_len": 4096})) == 65536
    assert max_prompt_chars(_config(ingress={"max_prompt_chars": 1000})) == 1000


@pytest.mark.parametrize("num_replicas, max_num_seqs", [(1, 4), (2, 64), (64, 256)])
def test_serve_never_caps_the_ingress_below_the_admission_gate(num_replicas, max_num_seqs):
    """Serve's max_ongoing_requests on the Ingress is above the gate, so overload is a 429, not a proxy queue."""
    from kvtide.cluster.app import ingress_deployment_options

    config = _config(replicas={"num_replicas": num_replicas}, engine={"max_num_seqs": max_num_seqs})
    gate = admission_limits(config).max_ongoing_requests
    assert ingress_deployment_options(config)["max_ongoing_requests"] > gate


def test_direct_mode_serve_slots_leave_refusing_to_the_gate():
    """Direct mode: a burst of 500 above the gate gets Serve slots, so its 429s are the gate's OpenAI JSON."""
    from kvtide.cluster.app import engine_deployment_options

    config = _config(engine={"max_num_seqs": 4}, replicas={"num_replicas": 1})
    direct = engine_deployment_options(config)
    gate = admission_limits(config).max_ongoing_requests
    assert direct["max_ongoing_requests"] >= gate + 500
    # Serve counts a simultaneous burst as queued even with free slots: no limit there.
    assert direct["max_queued_requests"] == -1
    via_ingress = engine_deployment_options(_config(http={"mode": "ingress"}, engine={"max_num_seqs": 4},
                                                    replicas={"num_replicas": 1}))
    assert via_ingress["max_queued_requests"] == admission_limits(
        _config(http={"mode": "ingress"}, engine={"max_num_seqs": 4}, replicas={"num_replicas": 1})
    ).max_queued_requests_per_handle
