"""The KV-event endpoint: vLLM's publisher reaches the listener over it, and it leaves no file behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from kvtide.deployments.engine.kv_cache_tracker import KvCacheTracker
from kvtide.deployments.engine.kv_events import KvEventListener, new_ipc_endpoint
from kvtide.deployments.routing.block_hash import block_hashes

BLOCK_SIZE = 4
WAIT_S = 30.0  # a bound on a wait for a condition, not a pace: each loop ends as soon as it holds


def _bound_abstract_names() -> set[str]:
    """Abstract Unix socket names bound on this host (the kernel lists them with a leading @)."""
    with open("/proc/net/unix") as f:
        next(f)  # header
        return {fields[7] for fields in (line.split() for line in f) if len(fields) > 7 and fields[7].startswith("@")}


def test_vllms_publisher_reaches_the_listener_over_an_abstract_endpoint_that_has_no_file():
    """A batch vLLM's ZMQ publisher sends on the endpoint lands in the tracker; the name is abstract."""
    from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

    endpoint = new_ipc_endpoint()
    name = endpoint.removeprefix("ipc://")
    publisher = ZmqEventPublisher(0, endpoint=endpoint, topic="kv")
    tracker = KvCacheTracker("r1", epoch=1, block_size=BLOCK_SIZE)
    listener = KvEventListener(endpoint, tracker)
    listener.start()
    tokens = [11, 12, 13, 14]
    hashes = block_hashes(tokens, BLOCK_SIZE)
    try:
        assert name.startswith("@") and name in _bound_abstract_names()
        assert not os.path.exists(name)
        deadline = time.monotonic() + WAIT_S
        # PUB drops what it sends before the subscription arrives: send until one batch lands.
        while not tracker.cached_prefix_blocks(hashes, tokens) and time.monotonic() < deadline:
            publisher.publish(KVEventBatch(ts=time.time(), events=[BlockStored(
                block_hashes=[1], parent_block_hash=None, token_ids=tokens, block_size=BLOCK_SIZE,
                lora_id=None, medium="GPU", lora_name=None)]))
            publisher._event_queue.join()  # sent, not merely queued
        assert tracker.cached_prefix_blocks(hashes, tokens) == 1  # the block, in the router's hash
    finally:
        listener.stop()
        publisher.shutdown()


def test_an_engine_killed_outright_leaves_its_endpoint_neither_bound_nor_on_disk(tmp_path):
    """SIGKILL on the binding process frees the abstract name; no socket file remains in the temp dir."""
    endpoint = new_ipc_endpoint()
    name = endpoint.removeprefix("ipc://")
    binder = subprocess.Popen(
        [sys.executable, "-c", "import sys, zmq\n"
         "s = zmq.Context.instance().socket(zmq.PUB); s.bind(sys.argv[1]); print('bound', flush=True)\n"
         "sys.stdin.read()", endpoint],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert binder.stdout.readline().strip() == "bound"
        assert name in _bound_abstract_names()
    finally:
        binder.send_signal(signal.SIGKILL)
        binder.wait()
    assert name not in _bound_abstract_names()
    assert list(tmp_path.iterdir()) == []
