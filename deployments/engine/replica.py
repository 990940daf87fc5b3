"""Engine replica: one vLLM AsyncLLM (v1) inside a Ray Serve replica.

The replica receives token ids (its frontend or the routing peer tokenized them), streams `GenerateDelta`s
back, and exports vLLM's engine metrics through Ray's metrics agent (vLLM's Ray stat
logger) so one Prometheus scrape of the Ray metrics port sees them.

Invariants:
- A cancelled call (client disconnect, upstream timeout) aborts the request in the
  engine, so its KV blocks are freed: AsyncLLM.generate aborts on CancelledError.
- `check_health` fails once the engine core is dead, so Ray Serve replaces the replica, and
  once the autoscaler has retired this replica (engine/standby.py), so Serve stops it.
- A standby replica is out of routing (its routing stats say so) and a sleeping engine is
  never called: a request reaching it gets a retryable error.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any, AsyncIterator, Callable

from ray import serve
from ray.util import metrics

from kvtide.deployments.logs import replica_logger
from kvtide.config import KvtideConfig, parse_config
from kvtide.deployments.engine.core_pinning import EngineCorePin, engine_core_pids, engine_cores_exited
from kvtide.deployments.engine.demo_model import resolve_model
from kvtide.deployments.engine.core_claims import CoreClaims, claim_threads_bind
from kvtide.deployments.engine.placement import bound_cores, engine_kwargs
from kvtide.autoscaling import roles_channel
from kvtide.autoscaling.replica_stats import RecentTokens, replica_autoscaling_stats
from kvtide.autoscaling.warm_start import fleet_view, plan_prefills
from kvtide.deployments.engine.engine_config import start_engine
from kvtide.deployments.engine.kv_cache_tracker import KvCacheTracker
from kvtide.deployments.engine.kv_events import KvEventListener, new_ipc_endpoint
from kvtide.deployments.engine.kv_tier_stats import configured_load_gib_per_s, onload_tokens_per_s, tier_configured
from kvtide.deployments.messages import KVTIDE_PATH, Finished, GenerateDelta, GenerateRequest, VllmLayerCall
from kvtide.deployments.names import INGRESS_DEPLOYMENT
from kvtide.deployments.routing.trust import read_prediction
from kvtide.deployments.engine.pending_prefill import PendingPrefill
from kvtide.deployments.engine.request_book import BookedEngine, RequestBook
from kvtide.deployments.engine.standby import ROLE_POLL_S, EngineRole
from kvtide.deployments.engine.start_phases import WAKE_PHASE, describe, start_phases
from kvtide.deployments.engine.vllm_openai import build_vllm_openai_app, system_fingerprint
from kvtide.deployments.engine.response_ids import tagging_app
from kvtide.deployments.routing.response_pins import STORE_ENV

logger = replica_logger("engine")

# How often the replica re-records vLLM's gauges (Ray drops a series not set for ~20 s).
GAUGE_REFRESH_S = 5.0
# How long a new replica waits for the routers' hot-prefix lists before starting cold.
WARM_START_LOOKUP_TIMEOUT_S = 5.0
# Step payloads vLLM's KV-event publisher keeps for replays (kvtide asks for none).
KV_EVENTS_REPLAY_STEPS = 1


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (unit use): any stable name will do
        return f"local-{os.getpid()}"


def _replica_rank() -> int:
    try:
        return int(serve.get_replica_context().rank.rank)
    except Exception:  # rank is best effort: only used to spread CPU thread binding
        return 0


def engine_core_pin(device: str, core_pids: list[int]) -> EngineCorePin | None:
    """On CPU, the pin for this replica's engine cores (see core_pinning); None on GPU or when the binding is unreadable."""
    if device != "cpu":
        return None
    threads_bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    try:
        cores = bound_cores(threads_bind)
    except ValueError:
        logger.warning("engine core left unpinned: cannot read VLLM_CPU_OMP_THREADS_BIND=%r", threads_bind)
        return None
    return EngineCorePin(cores, frozenset(os.sched_getaffinity(0)), lambda: core_pids) if cores else None


class EngineReplica:
    """Ray Serve deployment class hosting one vLLM engine (options set by kvtide.cluster.app)."""

    # The deployment whose `hot_prefixes()` a new replica asks before it takes traffic:
    # whoever sees every request's tokens (the ingress; the routing peer in direct mode).
    HOT_PREFIX_SOURCE = INGRESS_DEPLOYMENT

    async def __init__(self, config_dict: dict):
        constructor_s = time.time()
        import vllm.v1.engine.async_llm  # noqa: F401  (here, so start_phases times vLLM's import as its own phase)
        from kvtide.deployments.engine.stats import (EngineLoad, KvTierMetrics, engine_kv_bytes_per_token,
                                                     engine_num_workers, kept_ray_stat_logger, load_logger_factory)

        imported_s = time.time()
        self.config: KvtideConfig = parse_config(config_dict)
        self.replica_id = _replica_id()
        # Held for the replica's life: its cores stay claimed while it runs (core_claims.py).
        self.core_claims = CoreClaims()
        if self.config.resources.device == "cpu" and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = claim_threads_bind(
                _replica_rank(), self.config.engine.tensor_parallel_size, sorted(os.sched_getaffinity(0)),
                self.core_claims)
        if self.config.serving.responses_store:  # read by vLLM's layer when it is built, below
            os.environ[STORE_ENV] = "1"
        kwargs = engine_kwargs(self.config, resolve_model(self.config.model))
        # Cache truth for the router: vLLM publishes KV events on a per-replica IPC socket,
        # a listener thread folds them into a block set in kvtide hashes.
        self.kv_listener: KvEventListener | None = None
        if self.config.engine.enable_prefix_caching:
            from vllm.config import KVEventsConfig

            endpoint = new_ipc_endpoint()
            tracker = KvCacheTracker(self.replica_id, epoch=time.time_ns(), block_size=self.config.engine.block_size)
            self.kv_listener = KvEventListener(endpoint, tracker)
            self.kv_listener.start()
            # buffer_steps: vLLM keeps the last N step payloads for replay requests, which the
            # listener never makes (no replay endpoint); its default of 10,000 grows the engine
            # core's memory by hundreds of MB under steady traffic before it levels off.
            kwargs["kv_events_config"] = KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic="kv",
                buffer_steps=KV_EVENTS_REPLAY_STEPS)
        logger.info("starting vLLM engine: %s (bind=%s)", kwargs, os.environ.get("VLLM_CPU_OMP_THREADS_BIND"))
        self.load = EngineLoad()
        self.pending_prefill = PendingPrefill()
        # Every generation booked alike, kvtide's path and vLLM's layer (request_book.py).
        self.booked_requests = metrics.Counter(
            "kvtide_engine_booked_requests", "Generation requests this engine replica booked for the routers "
            "(pending prefill, hits), by the path that made them: kvtide's own, or vLLM's serving layer.",
            tag_keys=("model", "path"))
        self.booked_prefill_tokens = metrics.Counter(
            "kvtide_engine_booked_prefill_tokens", "Uncached prompt tokens booked as pending prefill, by path.",
            tag_keys=("model", "path"))
        self.exclusive_hits = metrics.Counter(
            "kvtide_engine_exclusive_hit_tokens", "Prompt tokens served from cached blocks no other replica held "
            "when the request was routed (this cache's worth to a cache-aware scale-down), by path.",
            tag_keys=("model", "path"))
        # Direct mode: the frontend in this replica counts index trust for vLLM's layer's requests (server.py).
        self.observe_finished: Callable[[Finished], None] = lambda finished: None
        self.book = RequestBook(self.replica_id, self.pending_prefill, self._uncached_tokens, self._on_booked,
                                self._on_finished)
        self.prometheus_loggers: list = []
        if isinstance(kwargs.get("structured_outputs_config"), dict):  # the config's plain form
            from vllm.config import StructuredOutputsConfig

            kwargs["structured_outputs_config"] = StructuredOutputsConfig(**kwargs["structured_outputs_config"])
        # The CPU KV tier (engine.kv_offload; size_gib unset: no tier).
        kv_offload = self.config.engine.kv_offload
        self._kv_tier = tier_configured(kv_offload)
        self._onload_gib_per_s = configured_load_gib_per_s(kv_offload)
        # Resolved as `vllm serve` resolves it (engine_config.py): the same flags give the same engine.
        self.engine = start_engine(
            kwargs, stat_loggers=[kept_ray_stat_logger(self.prometheus_loggers),
                                  load_logger_factory(self.load, kv_tier=self._kv_tier)])
        engine_s = time.time()
        # What onload_tokens_per_s divides by, and the workers whose transfer seconds vLLM sums.
        self._kv_bytes_per_token = engine_kv_bytes_per_token(self.engine.vllm_config)
        self.load.onload_rate.num_workers = engine_num_workers(self.engine.vllm_config)
        self.kv_tier_metrics = KvTierMetrics(self.config.model_name, self.replica_id)
        self._export_kv_tiers()
        # The model's generation_config sampling defaults (temperature, top_k, …), applied to the
        # fields a request leaves unset, as vLLM's OpenAI server applies them.
        self.sampling_defaults = self.engine.vllm_config.model_config.get_diff_sampling_param()
        # vLLM's own OpenAI app on this engine, for the requests kvtide's path does not implement
        # (the frontend hands them over in-process in direct mode, over `vllm_openai` in ingress mode).
        self.vllm_app = await build_vllm_openai_app(self.config, BookedEngine(self.engine, self.book))
        self.system_fingerprint = system_fingerprint(self.vllm_app)
        if self.config.serving.responses_store:  # each stored response's id names this replica
            self.vllm_app = tagging_app(self.vllm_app, self.replica_id)
        # The engine-core processes this replica started, for the health check and the CPU pin.
        self.engine_core_pids = engine_core_pids(self.engine)
        self.core_pin = engine_core_pin(self.config.resources.device, self.engine_core_pids)
        if self.core_pin:
            self.core_pin.apply()
        # vLLM's request_success counter does not count aborts; kvtide does.
        self.aborted_requests = metrics.Counter(
            "kvtide_engine_aborted_requests", "Requests aborted in the engine because the caller went away.",
            tag_keys=("model",))
        self.warmup_tokens = metrics.Counter(
            "kvtide_engine_warmup_prefill_tokens", "Prompt tokens a new replica prefilled before taking traffic.",
            tag_keys=("model",))
        self._in_flight = 0  # generate and vLLM-layer calls running here (a move to standby drains them)
        autoscaling = self.config.autoscaling
        self._recent_hits = RecentTokens(autoscaling.cache_value_window_s)
        # Prompt tokens served from blocks no other replica held when routed (routing.trust, booked
        # by self.book): with _recent_hits, this cache's worth to a cache-aware scale-down.
        self._recent_exclusive_hits = RecentTokens(autoscaling.cache_value_window_s)
        # Standby engines and cache-aware scale-down: the autoscaler assigns this replica a role.
        self.role = EngineRole(self.engine, can_sleep=bool(kwargs.get("enable_sleep_mode")),
                               sleep_level=autoscaling.sleep_level,
                               drain_timeout_s=self.config.frontend.admission.request_timeout_s or 600.0,
                               in_flight=self._requests_in_flight, warm_start=self._warm_start)
        # Serve marks the replica running only when this constructor returns: warm first.
        await self._warm_start()
        self._record_start(constructor_s, imported_s, engine_s, time.time())
        # vLLM's gauges exist from now on, and stay while the engine idles.
        self._gauge_refresh = asyncio.get_running_loop().create_task(self._refresh_gauges())
        self._role_follower = None
        if self.config.replicas.autoscaling and autoscaling.manages_roles:
            self._role_follower = asyncio.get_running_loop().create_task(self._follow_role())

    def _requests_in_flight(self) -> int:
        return self._in_flight

    async def _follow_role(self) -> None:
        """Poll the role the autoscaler assigned this replica and move to it (engine/standby.py)."""
        context = serve.get_replica_context()
        while True:
            try:
                document = await asyncio.to_thread(roles_channel.read, context.app_name, context.deployment)
                await self.role.apply(roles_channel.role_of(document, self.replica_id))
            except Exception as exc:  # the GCS briefly unreachable, or a move failed: try again next poll
                logger.warning("following the autoscaler's role failed: %s: %s", type(exc).__name__, exc)
            await asyncio.sleep(ROLE_POLL_S)

    def _refuse_if_asleep(self) -> None:
        if self.role.refuses_requests:
            from ray.serve.exceptions import ReplicaUnavailableError

            # Retryable: the ingress and HAProxy send it to another replica.
            raise ReplicaUnavailableError("this engine replica is a standby (asleep); retry on another replica")

    def _record_start(self, constructor_s: float, imported_s: float, engine_s: float, warm_s: float) -> None:
        import psutil

        phases = start_phases(psutil.Process().create_time(), constructor_s, imported_s, engine_s, warm_s)
        logger.info("replica %s start-up: %s", self.replica_id, describe(phases))
        self._start_gauge = metrics.Gauge("kvtide_engine_start_phase_seconds",
                                          "Seconds this engine replica's start-up spent per phase (process, import, "
                                          "engine, warm_start; wake once a standby was woken).",
                                          tag_keys=("model", "phase"))
        self._start_phases = phases
        self._set_start_phases()

    def _set_start_phases(self) -> None:
        # Set again with the other gauges (_refresh_gauges): Ray's metrics agent drops a gauge
        # that is not set for a while, so a fleet whose replicas all started long ago would show
        # "No data" in the start-up panel.
        phases = dict(self._start_phases)
        if self.role.last_wake_s is not None:  # a standby's wake replaces a cold start
            phases[WAKE_PHASE] = self.role.last_wake_s
        for phase, seconds in phases.items():
            self._start_gauge.set(seconds, {"model": self.config.model_name, "phase": phase})

    async def _refresh_gauges(self) -> None:
        from kvtide.deployments.engine.stats import refresh_gauges

        while True:
            try:
                refresh_gauges(self.prometheus_loggers, self.load)
                self._set_start_phases()
                self._export_kv_tiers()
                if self.core_pin:  # free any thread the engine core started since (it inherits the pin)
                    self.core_pin.apply()
            except Exception as exc:  # metrics must never take the replica down
                logger.warning("refreshing vLLM's gauges failed: %s", type(exc).__name__)
            await asyncio.sleep(GAUGE_REFRESH_S)

    def _onload_tokens_per_s(self) -> float:
        """Prompt tokens' KV per second this replica loads from its CPU tier (kv_tier_stats); 0.0: no tier, or not known."""
        if not self._kv_tier:
            return 0.0
        return onload_tokens_per_s(self.load.onload_rate.bytes_per_s(), self._onload_gib_per_s,
                                   self._kv_bytes_per_token)

    def _export_kv_tiers(self) -> None:
        """The KV tiers' series (blocks held, hits, bytes moved, onload rate): zeros where there is no tier."""
        tracker = self.kv_listener.tracker if self.kv_listener is not None else None
        num_gpu_blocks = tracker.num_blocks if tracker is not None else 0
        num_cpu_blocks = tracker.num_cpu_blocks if tracker is not None else 0
        self.kv_tier_metrics.export(self.load, num_gpu_blocks, num_cpu_blocks, self._onload_tokens_per_s())

    async def _warm_start(self) -> None:
        """Prefill the fleet's hottest shared prefixes (all HOT_PREFIX_SOURCE replicas' views) before serving."""
        warm = self.config.autoscaling.warm_start
        if not (warm.enabled and warm.token_budget > 0 and self.config.engine.enable_prefix_caching):
            return
        try:
            app_name = serve.get_replica_context().app_name
            source = serve.get_deployment_handle(self.HOT_PREFIX_SOURCE, app_name=app_name)
            # Every router replica (one routing peer per node, or each ingress replica) sees
            # only what it routes: ask them all, and merge.
            views = await source.broadcast("hot_prefixes").results_async(
                timeout_s=WARM_START_LOOKUP_TIMEOUT_S, return_exceptions=True)
        except Exception as exc:  # no ingress/router yet (first deploy) or it is busy: start cold
            logger.info("warm start skipped: no hot-prefix list (%s)", type(exc).__name__)
            return
        hot = fleet_view(views)
        block_size = self.config.engine.block_size
        capacity_tokens = (self.engine.vllm_config.cache_config.num_gpu_blocks or 0) * block_size
        plan = plan_prefills(hot, warm.token_budget, capacity_tokens, warm.max_prefixes,
                             max_kv_fraction=warm.max_kv_fraction, block_size=block_size)
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        started_s = time.monotonic()
        for i, (tokens, salt) in enumerate(plan):
            # One output token: the point is the prefill, which leaves the blocks cached (under a tenant's
            # salt where the prefix is a tenant's, deployments/tenancy.py).
            prompt = TokensPrompt(prompt_token_ids=tokens)
            if salt is not None:
                prompt["cache_salt"] = salt
            async for _ in self.engine.generate(prompt, SamplingParams(max_tokens=1),
                                                request_id=f"kvtide-warmup-{self.replica_id}-{i}"):
                pass
            self.warmup_tokens.inc(len(tokens), {"model": self.config.model_name})
        if plan:
            logger.info("warm start: prefilled %d prefixes (%d tokens) in %.2f s", len(plan),
                        sum(len(tokens) for tokens, _ in plan), time.monotonic() - started_s)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self._refuse_if_asleep()
        spec = request.sampling
        params = SamplingParams(**spec.vllm_kwargs(self.sampling_defaults), output_kind=RequestOutputKind.DELTA)
        called_s = time.perf_counter()
        num_output_tokens = 0
        prompt = TokensPrompt(prompt_token_ids=request.prompt_token_ids)
        if request.cache_salt is not None:
            prompt["cache_salt"] = request.cache_salt  # vLLM keeps this salt's cached blocks apart
        outputs = self.book.track(self.engine.generate(prompt, params, request_id=request.request_id),
                                  request.request_id, KVTIDE_PATH, request.prompt_token_ids, request.block_hashes,
                                  request.cache_salt, read_prediction(request.decision))
        self._in_flight += 1
        try:
            async for out in outputs:
                completion = out.outputs[0]
                first = num_output_tokens == 0 and len(completion.token_ids) > 0
                num_output_tokens += len(completion.token_ids)
                yield GenerateDelta(
                    text=completion.text,
                    num_output_tokens=num_output_tokens,
                    num_prompt_tokens=len(request.prompt_token_ids),
                    num_cached_tokens=out.num_cached_tokens or 0,
                    finish_reason=completion.finish_reason if out.finished else None,
                    engine_ttft_s=time.perf_counter() - called_s if first else None,
                    replica_id=self.replica_id,
                    token_ids=tuple(completion.token_ids),
                    stop_reason=completion.stop_reason if out.finished else None,
                )
        except (asyncio.CancelledError, GeneratorExit):
            # The caller went away (client disconnect, deadline, handle cancel) or closed the
            # stream early. Closing vLLM's generator aborts the request in the engine core,
            # freeing its KV blocks (a cancelled one has aborted already).
            self.aborted_requests.inc(1, {"model": self.config.model_name})
            await outputs.aclose()
            raise
        finally:
            self._in_flight -= 1

    async def vllm_openai(self, call: VllmLayerCall) -> AsyncIterator[dict[str, Any]]:
        """Ingress mode: one request answered by vLLM's own serving layer here, streamed back as the
        ASGI messages vLLM's app sends. A cancelled stream (the client left, the deadline passed)
        cancels the app, which aborts the request in the engine."""
        self._refuse_if_asleep()
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": call.method,
                 "scheme": "http", "path": call.path, "raw_path": call.path.encode(), "root_path": "",
                 "query_string": call.query_string, "headers": list(call.headers), "client": None, "server": None}
        messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": call.body, "more_body": False}
            await asyncio.Event().wait()  # the caller leaving arrives as this generator's cancellation
            return {"type": "http.disconnect"}

        async def run() -> None:
            try:
                await self.vllm_app(scope, receive, messages.put)
            finally:
                messages.put_nowait(None)

        task = asyncio.get_running_loop().create_task(run())
        self._in_flight += 1
        try:
            while (message := await messages.get()) is not None:
                yield message
            await task  # vLLM's app failing after its last message is this call's failure
        finally:
            self._in_flight -= 1
            task.cancel()

    async def vllm_openai_answer(self, call: VllmLayerCall) -> tuple[int, bytes]:
        """Handle method, broadcast to every replica (vllm_layer.fleet_caller): a request that must reach the
        whole fleet (an abort: its requests may run on any replica) answered by this replica's vLLM layer, as
        (status, body). A sleeping standby runs no request: nothing to do there."""
        if self.role.refuses_requests:
            return 200, b""
        status, body = 500, b""
        async for message in self.vllm_openai(call):
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                body += message.get("body", b"")
        return status, body

    def _uncached_tokens(self, token_ids: list[int], block_hashes: list[int] | None, cache_salt: str | None) -> int:
        """The prompt tokens this replica must still compute for a prompt (its own block set's view; hashed from
        the tokens where no block hashes came with it)."""
        cached_blocks = 0
        if self.kv_listener is not None:
            cached_blocks = self.kv_listener.tracker.cached_prefix_blocks(block_hashes or (), token_ids, cache_salt)
        return PendingPrefill.uncached_tokens(len(token_ids), cached_blocks, self.config.engine.block_size)

    def _on_booked(self, path: str, uncached_tokens: int) -> None:
        tags = {"model": self.config.model_name, "path": path}
        self.booked_requests.inc(1, tags)
        if uncached_tokens:  # Ray counters refuse increments of 0
            self.booked_prefill_tokens.inc(uncached_tokens, tags)

    def _on_finished(self, finished: Finished) -> None:
        if finished.exclusive_hit_tokens:
            self.exclusive_hits.inc(finished.exclusive_hit_tokens, {"model": self.config.model_name,
                                                                    "path": finished.path})
        self.observe_finished(finished)

    async def ready(self) -> bool:
        """Cheap call a frontend uses for /ready: answered only by a running replica."""
        return not self.engine.errored

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve pulls this every `request_routing_stats_period_s` for the routers."""
        load = self.load
        stats: dict[str, Any] = {
            # Lets a pick-only router (direct mode) tell a fresh report from the last one.
            "reported_s": time.time(),
            "num_running": load.num_running,
            "num_waiting": load.num_waiting,
            "kv_usage_perc": load.kv_usage_perc,
            "pending_prefill_tokens": self.pending_prefill.total_tokens,
            # How fast that backlog drains (0.0: not known yet): the router drains the
            # report by it until the next one (deployments.routing.backlog).
            "prefill_tokens_per_s": self.pending_prefill.drain_rate_tokens_per_s(time.monotonic()),
            # How fast a CPU-tier hit's KV loads back into GPU (0.0: no CPU tier, or not known): the
            # router weighs a CPU-tier match by it (deployments.engine.kv_tier_stats).
            "onload_tokens_per_s": self._onload_tokens_per_s(),
            # How long its requests take end to end (quantiles; () before the first): a pick-only
            # router stops counting a pick once it has probably finished (deployments.routing.pick_load).
            "request_durations_s": load.recent_durations.quantiles(),
            # A standby (or a replica on its way there or back) takes no requests: routers leave it out.
            "standby": not self.role.routed,
        }
        if self.kv_listener is not None:
            stats["digest"] = self.kv_listener.digest(time.time())
        return stats

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve pulls this for the KV autoscaling policy (autoscaling.ray_policy)."""
        load = self.load
        now_s = time.monotonic()
        self._recent_hits.observe(now_s, load.prefix_hit_tokens_total)
        self._recent_exclusive_hits.observe(now_s, self.book.exclusive_hit_tokens_total)
        return replica_autoscaling_stats(load.kv_usage_perc, load.num_waiting, load.num_running,
                                         load.num_preemptions_total, self._recent_hits.within(now_s),
                                         self._recent_exclusive_hits.within(now_s))

    def engine_dead(self) -> bool:
        """Whether this replica's engine is dead: vLLM says so (its engine-core monitor), or the
        process table does (the engine core exited, before vLLM's monitor has marked it). Never raises."""
        return bool(self.engine.errored) or engine_cores_exited(self.engine_core_pids)

    async def check_health(self) -> None:
        # Raises EngineDeadError once the engine core died: Serve then restarts the replica.
        await self.engine.check_health()
        # The process table too: a replica must not stay "healthy" with no engine core behind it.
        if engine_cores_exited(self.engine_core_pids):
            raise RuntimeError(f"the engine core process(es) {self.engine_core_pids} exited")
        if self.role.retired:  # the autoscaler chose this replica to stop (autoscaling/standby.py)
            raise RuntimeError("retired by the autoscaler: a standby past autoscaling.standby_timeout_s")

    def __del__(self) -> None:
        for task in (getattr(self, "_gauge_refresh", None), getattr(self, "_role_follower", None)):
            if task is not None:
                task.cancel()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        listener = getattr(self, "kv_listener", None)
        if listener is not None:
            listener.stop()
