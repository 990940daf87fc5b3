"""Pair this session's two overhead runs into one comparison (paired/report.md, paired/results.json).

The overhead run was started for kvtide and bare vLLM together, alternated; kvtide's warm-up start
failed (the device's kvtide, unpacked from its wheel, had no `kvtide-haproxy` console script: see
README.md), so that run measured bare vLLM alone (vllm-runs/). kvtide's three repeats ran right
after on the same machine (kvtide-runs/). This pairs repeat i of each with
benchmarks.overhead.server_levels, the function the overhead run itself uses, so the cells, ratios
and verdicts are computed as in any overhead report; only the order differs from the protocol's.

    cd benchmarks/results/h100-session-2026-12-06 && ../../../.venv/bin/python pair.py
"""

import argparse
import json
from pathlib import Path

from kvtide.benchmarks.overhead import markdown, server_levels
from kvtide.benchmarks.protocol import Run, provenance_markdown

HERE = Path(__file__).resolve().parent


def repeats_of(results: dict, server: str) -> list[dict[int, dict] | None]:
    levels = results["servers"][server]["levels"]
    return [{int(c): entry["repeats"][i] for c, entry in levels.items()} for i in range(results["repeats"])]


def main() -> None:
    first = json.loads((HERE / "vllm-runs/results.json").read_text())
    second = json.loads((HERE / "kvtide-runs/results.json").read_text())
    runs = {"kvtide": repeats_of(second, "kvtide"), "vllm": repeats_of(first, "vllm")}
    order = ([Run("vllm", -1)] + [Run("vllm", i) for i in range(3)]
             + [Run("kvtide", -1)] + [Run("kvtide", i) for i in range(3)])
    args = argparse.Namespace(input_len=512, output_len=128, num_requests=160, duration=15.0, repeats=3,
                              warmup_requests=second["warmup_requests"], concurrency=[1, 32, 128])
    levels = server_levels(runs)
    text = markdown(levels, args, second["command"], second["hardware"], order)
    text = text.replace("per server in alternated order,", "per server, NOT alternated (every bare vLLM run, then "
                        "every kvtide run, on the same machine: see README.md),")
    engine_equal = first["servers"]["vllm"]["engine_config"] == second["servers"]["kvtide"]["engine_config"]
    text += (f"\nResolved engine settings equal between the two servers: {engine_equal} "
             "(`servers.<name>.engine_config` in each run's results.json).\n\n"
             "bare vLLM's run:\n\n" + provenance_markdown(first["provenance"])
             + "\nkvtide's run:\n\n" + provenance_markdown(second["provenance"]))
    out = HERE / "paired"
    out.mkdir(exist_ok=True)
    (out / "report.md").write_text(text)
    servers = {"kvtide": {"engine_config": second["servers"]["kvtide"]["engine_config"], "levels": levels["kvtide"]},
               "vllm": {"engine_config": first["servers"]["vllm"]["engine_config"], "levels": levels["vllm"]}}
    (out / "results.json").write_text(json.dumps(
        {"provenance": {"vllm": first["provenance"], "kvtide": second["provenance"]}, "repeats": 3,
         "alternated": False, "order": [[r.server, r.repeat] for r in order], "hardware": second["hardware"],
         "command": second["command"], "engine_config_equal": engine_equal, "servers": servers},
        indent=2, default=str) + "\n")
    print(text)


if __name__ == "__main__":
    main()
