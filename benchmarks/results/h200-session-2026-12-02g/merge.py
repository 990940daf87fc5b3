"""Merge this session's overhead runs into one table (ratios to bare vLLM) with benchmarks.overhead's own markdown.

    .venv/bin/python benchmarks/results/h200-session-2026-12-02g/merge.py > benchmarks/results/h200-session-2026-12-02g/overhead-8b/report.md
"""
import argparse
import json
from pathlib import Path

from kvtide.benchmarks.overhead import markdown, paths_markdown, scrapes_markdown

here = Path(__file__).parent
vllm = json.loads((here / "overhead-8b/results-vllm.json").read_text())
kvtide = json.loads((here / "overhead-8b/results-kvtide.json").read_text())
inline = json.loads((here / "overhead-8b-inline/results.json").read_text())
peer = json.loads((here / "overhead-8b-peer/results.json").read_text())
results = {"vllm": vllm["results"]["vllm"], "kvtide": kvtide["results"]["kvtide"],
           "kvtide (peer tokenizes on its loop)": inline["results"]["kvtide"],
           "ray-serve-llm": peer["results"]["ray-serve-llm"]}
results = {name: {int(c): r for c, r in levels.items()} for name, levels in results.items()}
args = argparse.Namespace(input_len=512, output_len=128, num_requests=200, duration=150)
print(markdown(results, args, "(four runs of one driver session, merged: see README.md)", kvtide["hardware"]))
print(paths_markdown({**kvtide["ttft_paths"], **vllm["ttft_paths"]}, 40))
print("kvtide (default, 4 tokenizer threads):" + scrapes_markdown(kvtide["metrics_scrapes"]))
print("kvtide with the peer tokenizing on its event loop:" + scrapes_markdown(inline["metrics_scrapes"]))
