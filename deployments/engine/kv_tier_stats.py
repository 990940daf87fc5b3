"""The CPU KV tier in numbers: what vLLM's KV offloading moved, and how fast this engine loads it back.

With `engine.kv_offload`, vLLM's OffloadingConnector stores GPU blocks to host memory
(offload, GPU → CPU) and loads them back on a prefix hit beyond the GPU cache (onload,
CPU → GPU). Its transfer stats reach the replica's stat logger in each scheduler stats
record (`SchedulerStats.kv_connector_stats`, the connector's payload for that step):

    {"types": {name: "counter" | "gauge" | "histogram"},
     "data":  {name: {label values: value}}}       OffloadingConnectorStats.data (vLLM 0.26, 0.32)
    {connector name: <that payload>, ...}           the same, under a MultiConnector

Counters are increments since the connector's previous report, summed over the engine's
workers: `vllm:kv_offload_load_bytes` / `_load_time` (onload) and `_store_bytes` /
`_store_time` (offload).

How fast the tier loads, in prompt tokens per second (`onload_tokens_per_s`, reported to the
routers): a CPU-tier hit saves the prefill of its tokens but costs their load, so the router
weighs it by this rate.

    measured (once OnloadRate holds MIN_MEASURED_BYTES of recent loads):
        engine bytes/s = Σ bytes / (Σ seconds / workers)     the workers load their shards at once
        tokens/s       = engine bytes/s / KV bytes per token (all workers' shards of one token)
    else configured: engine.kv_offload.load_gib_per_s × 2^30 / KV bytes per token
    else (no tier, no figure, or the KV size unknown): 0.0, "not known"

Pure: no vLLM, no Ray; `deployments.engine.stats` feeds it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

GIB = 1 << 30

# vLLM's names for the OffloadingConnector's transfer counters (offloading/metrics.py, _TransferMetricName).
ONLOAD_BYTES = "vllm:kv_offload_load_bytes"
ONLOAD_TIME_S = "vllm:kv_offload_load_time"
OFFLOAD_BYTES = "vllm:kv_offload_store_bytes"
OFFLOAD_TIME_S = "vllm:kv_offload_store_time"
_PAYLOAD_DATA = "data"  # offloading/metrics.py, _StatsKey.DATA

# Below this many recently loaded bytes a measured rate is mostly per-transfer latency (a few
# blocks at a time), not bandwidth: the configured figure is the better guess until then.
MIN_MEASURED_BYTES = 8 << 20
# Recent onload records kept: enough to span bursts of small loads, few enough to follow a
# change of load (another replica on the host's PCIe switch, pinned memory running out).
ONLOAD_WINDOW = 64

TIERS = ("gpu", "cpu")  # the `tier` label's values
DIRECTIONS = ("offload", "onload")  # the `direction` label's values: GPU → CPU, CPU → GPU


@dataclass(frozen=True)
class TransferTotals:
    """Bytes and transfer seconds each way; seconds are summed over the engine's workers, as vLLM reports them."""

    onload_bytes: int = 0
    onload_s: float = 0.0
    offload_bytes: int = 0
    offload_s: float = 0.0

    def __add__(self, other: TransferTotals) -> TransferTotals:
        return TransferTotals(self.onload_bytes + other.onload_bytes, self.onload_s + other.onload_s,
                              self.offload_bytes + other.offload_bytes, self.offload_s + other.offload_s)


def _counter_sum(data: Mapping[str, Any], name: str) -> float:
    """A counter's increment over all its label values (the transfer counters have none; a tiered
    spec's labelled ones add up the same); 0 when the step moved nothing that way."""
    by_labels = data.get(name)
    if not isinstance(by_labels, Mapping):
        return 0
    return sum(value for value in by_labels.values() if isinstance(value, (int, float)))


def _payloads(payload: Mapping[str, Any]) -> Iterable[Mapping[str, Any]]:
    """The offloading payloads in one `kv_connector_stats`: itself, or each connector's under a MultiConnector
    (vLLM 0.32 nests each connector's payload dict; 0.26 its stats object, whose `data` is that dict)."""
    if isinstance(payload.get(_PAYLOAD_DATA), Mapping):
        yield payload
        return
    for nested in payload.values():
        nested = nested if isinstance(nested, Mapping) else getattr(nested, "data", None)
        if isinstance(nested, Mapping) and isinstance(nested.get(_PAYLOAD_DATA), Mapping):
            yield nested


def transfer_totals(payload: Mapping[str, Any] | None) -> TransferTotals:
    """What one scheduler stats record's `kv_connector_stats` says was moved; zeros for None or
    another connector's payload (no offloading counters in it)."""
    total = TransferTotals()
    if not isinstance(payload, Mapping):
        return total
    for one in _payloads(payload):
        data = one[_PAYLOAD_DATA]
        total = total + TransferTotals(int(_counter_sum(data, ONLOAD_BYTES)), float(_counter_sum(data, ONLOAD_TIME_S)),
                                       int(_counter_sum(data, OFFLOAD_BYTES)), float(_counter_sum(data, OFFLOAD_TIME_S)))
    return total


class OnloadRate:
    """The engine's CPU → GPU load bandwidth over its recent onload records.

    `num_workers`: the engine's workers (tensor × pipeline parallel). vLLM sums bytes and
    seconds over them, and they load their shards of a block at the same time, so the
    engine's wall-clock seconds are the summed seconds over the workers.
    """

    def __init__(self, num_workers: int = 1, window: int = ONLOAD_WINDOW,
                 min_bytes: int = MIN_MEASURED_BYTES) -> None:
        self.num_workers = max(1, num_workers)
        self.min_bytes = min_bytes
        self._recent: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, num_bytes: int, seconds: float) -> None:
        """One record's onload; a record with no bytes or no time says nothing about the rate."""
        if num_bytes > 0 and seconds > 0.0:
            self._recent.append((num_bytes, seconds))

    def bytes_per_s(self) -> float | None:
        """The engine's recent onload bytes per wall-clock second; None below `min_bytes` (not measured)."""
        num_bytes = sum(b for b, _ in self._recent)
        seconds = sum(s for _, s in self._recent)
        if num_bytes < self.min_bytes or seconds <= 0.0:
            return None
        return num_bytes * self.num_workers / seconds


def onload_tokens_per_s(measured_bytes_per_s: float | None, configured_gib_per_s: float | None,
                        kv_bytes_per_token: int | None) -> float:
    """Prompt tokens' KV per second this engine loads from its CPU tier: measured, else configured; 0.0 if unknown.

    `kv_bytes_per_token`: one token's KV over all the engine's workers (None: not known).
    """
    if not kv_bytes_per_token or kv_bytes_per_token <= 0:
        return 0.0
    if measured_bytes_per_s is not None and measured_bytes_per_s > 0.0:
        return measured_bytes_per_s / kv_bytes_per_token
    if configured_gib_per_s is not None and configured_gib_per_s > 0.0:
        return configured_gib_per_s * GIB / kv_bytes_per_token
    return 0.0


def tier_configured(kv_offload: Any) -> bool:
    """Whether the config gives this replica a CPU KV tier (`engine.kv_offload` set, with a size)."""
    if kv_offload is None:
        return False
    return float(getattr(kv_offload, "size_gib", 0) or 0) > 0


def configured_load_gib_per_s(kv_offload: Any) -> float | None:
    """The configured CPU → GPU bandwidth of the engine (all its GPUs together), GiB/s; None: not given or no tier."""
    if not tier_configured(kv_offload):
        return None
    value = getattr(kv_offload, "load_gib_per_s", None)
    return float(value) if value else None


def kv_bytes_per_token(*, num_layers: int, num_kv_heads: int, head_size: int, elem_bytes: int, use_mla: bool,
                       num_workers: int) -> int:
    """One token's KV over all the engine's workers: K and V (MLA: one latent vector) for each layer one
    worker holds, × its KV heads × head size × element size, × workers (each holds and loads its own shard)."""
    per_worker = (1 if use_mla else 2) * num_layers * num_kv_heads * head_size * elem_bytes
    return per_worker * max(1, num_workers)


class CounterDeltas:
    """Cumulative totals → the increments since the last call, for counters that only take increments.

    The stat logger keeps running totals; the replica exports them now and then. A total
    that went down (it never should) restarts from there rather than sending a negative step.
    """

    def __init__(self) -> None:
        self._exported: dict[Any, float] = {}

    def steps(self, totals: Mapping[Any, float]) -> dict[Any, float]:
        """key → the positive increase of its total since the previous call (keys that did not rise are left out)."""
        out = {}
        for key, total in totals.items():
            step = total - self._exported.get(key, 0)
            self._exported[key] = total
            if step > 0:
                out[key] = step
        return out
