"""Subscribe to this replica's own vLLM KV events and keep its `KvCacheTracker` current.

vLLM's engine core (a child process of the replica) publishes `KVEventBatch`es on a
ZMQ PUB socket bound to a per-replica IPC endpoint (`new_ipc_endpoint`); a daemon thread here receives and
decodes them and applies each event to the tracker under a lock. The replica reads a
digest from the tracker in `record_routing_stats`.

Why a thread, not an asyncio task: the replica's constructor runs outside its event
loop, and a blocking SUB socket with a receive timeout is the simplest loop that
cannot starve request handling (decoding releases the GIL in msgspec).
"""

from __future__ import annotations

import threading
import uuid

from kvtide.deployments.logs import replica_logger
from kvtide.deployments.engine.kv_cache_tracker import KvCacheTracker
from kvtide.deployments.routing.snapshot import CacheDigest

logger = replica_logger("kv_events")

_RECV_TIMEOUT_MS = 200


def new_ipc_endpoint() -> str:
    """A fresh IPC endpoint, unique per replica, in Linux's abstract socket namespace.

    An abstract name has no file: the kernel frees it when the binding engine core exits,
    however it exits. A path under the temp dir outlived every engine core that was killed
    (a lost node, a failed health check, a cluster stopped), one file each.
    """
    return f"ipc://@kvtide-kv-{uuid.uuid4().hex[:12]}"


class KvEventListener:
    """Feeds a tracker from vLLM's ZMQ KV-event stream until `stop()`."""

    def __init__(self, endpoint: str, tracker: KvCacheTracker, topic: str = "kv"):
        self.endpoint = endpoint
        self.tracker = tracker
        self.topic = topic
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtide-kv-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def digest(self, now_s: float) -> CacheDigest:
        with self._lock:
            return self.tracker.digest(now_s)

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVTIMEO, _RECV_TIMEOUT_MS)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        sock.connect(self.endpoint)  # the engine binds; ZMQ reconnects until it does
        try:
            while not self._stop.is_set():
                try:
                    _topic, _seq, payload = sock.recv_multipart()
                except zmq.Again:
                    continue
                try:
                    batch = decoder.decode(payload)
                except msgspec.DecodeError:
                    logger.warning("undecodable KV event batch (%d bytes) ignored", len(payload))
                    continue
                with self._lock:
                    for event in batch.events:
                        self.tracker.apply(event)
        finally:
            sock.close()
