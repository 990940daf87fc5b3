"""Capacity planning (`autoscaling.capacity`) and the `kvtide plan` subcommand."""

from __future__ import annotations

import argparse
import json

import pytest

from kvtide.autoscaling.capacity import (
    GIB,
    ModelShape,
    estimate_num_params,
    plan_capacity,
    shape_from_config,
    suggest_tp,
)
from kvtide.autoscaling.cli import register

LLAMA_70B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 28672,
    "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8, "vocab_size": 128256,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
LLAMA_70B = ModelShape(num_layers=80, num_kv_heads=8, head_dim=128, dtype="bf16", num_attention_heads=64,
                       num_params=70_600_000_000)


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="kvtide")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code = args.func(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_llama_70b_kv_bytes_per_token():
    """Llama-3.1-70B in bf16 needs 2 × 80 × 8 × 128 × 2 = 327,680 KV bytes per token."""
    assert LLAMA_70B.kv_bytes_per_token == 327_680


def test_param_estimate_from_config():
    """The Llama-style estimate lands on 70.55 B parameters for Llama-3.1-70B's config."""
    assert estimate_num_params(LLAMA_70B_CONFIG) == 70_553_706_496


def test_shape_from_config_fallbacks():
    """KV heads fall back to attention heads, head_dim to hidden/heads, dtype from torch_dtype or dtype."""
    shape = shape_from_config({"num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 512, "dtype": "float32"})
    assert (shape.num_kv_heads, shape.head_dim, shape.dtype) == (8, 64, "float32")
    assert shape.kv_bytes_per_token == 2 * 4 * 8 * 64 * 4


def test_capacity_arithmetic():
    """KV capacity is (GPU mem × util − weights/TP − reserve) × TP, divided by KV bytes per token."""
    plan = plan_capacity(LLAMA_70B, gpu_mem_gib=139, max_model_len=131072, tensor_parallel_size=4)
    per_gpu = 139 * GIB * 0.9 - 70_600_000_000 * 2 / 4 - 2 * GIB
    assert plan.kv_bytes_per_replica == int(per_gpu * 4)
    assert plan.kv_tokens_per_replica == int(per_gpu * 4) // 327_680
    assert plan.max_full_context_requests == plan.kv_tokens_per_replica // 131072
    assert plan.requests_at_len == {1024: plan.kv_tokens_per_replica // 1024, 4096: plan.kv_tokens_per_replica // 4096}


def test_weights_that_do_not_fit_leave_no_kv():
    """A 70B model on one 80 GiB GPU has no KV capacity and the plan says it does not fit."""
    plan = plan_capacity(LLAMA_70B, gpu_mem_gib=80, max_model_len=8192, tensor_parallel_size=1)
    assert plan.kv_tokens_per_replica == 0 and not plan.fits


@pytest.mark.parametrize("gpu_mem_gib, max_model_len, expected", [
    (139, 131072, 4),   # TP 2 holds 2 full-context requests, TP 4 holds 9
    (80, 8192, 4),      # TP 1: weights overflow; TP 2: 27k tokens < 4 × 8192
    (80, 1_000_000, None),
])
def test_suggested_tp_is_smallest_power_of_two_that_fits(gpu_mem_gib, max_model_len, expected):
    """The suggestion is the smallest power-of-two TP holding 4 full-context requests (None if none does)."""
    assert suggest_tp(LLAMA_70B, 70_600_000_000 * 2, gpu_mem_gib, max_model_len) == expected


def test_kv_heads_replicate_when_tp_exceeds_them():
    """With TP above the KV-head count each GPU keeps a whole head, so tokens per replica stop growing with TP."""
    shape = ModelShape(num_layers=32, num_kv_heads=2, head_dim=128, dtype="bf16", num_params=1_000_000_000)
    tp2 = plan_capacity(shape, 80, 4096, 2)
    tp4 = plan_capacity(shape, 80, 4096, 4)
    assert tp4.kv_bytes_per_replica > tp2.kv_bytes_per_replica
    assert tp4.kv_tokens_per_replica == pytest.approx(tp2.kv_tokens_per_replica * tp4.kv_bytes_per_replica
                                                      / tp2.kv_bytes_per_replica / 2, rel=1e-6)


def test_cli_reads_config_json(tmp_path, capsys):
    """`kvtide plan --model DIR` reads DIR/config.json and prints KV bytes per token, weights and capacity."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B_CONFIG))
    code, out, _ = run_cli(["plan", "--model", str(tmp_path), "--gpu-mem-gib", "139", "--tp", "4",
                            "--max-model-len", "131072"], capsys)
    assert code == 0
    assert "KV bytes per token:       327,680" in out
    assert "141,107,412,992 bytes" in out  # 70,553,706,496 params × 2 bytes
    assert "suggested TP size:        4" in out
    assert "at full context (131,072 tokens)" in out and "at 1,024 tokens" in out and "at 4,096 tokens" in out


def test_cli_with_explicit_shape_prints_the_numbers(capsys):
    """Shape flags plus --params-b give the same KV bytes and the computed capacity."""
    code, out, _ = run_cli(["plan", "--layers", "80", "--kv-heads", "8", "--head-dim", "128", "--dtype", "bf16",
                            "--params-b", "70.6", "--gpu-mem-gib", "139", "--tp", "4", "--max-model-len", "131072"],
                           capsys)
    plan = plan_capacity(LLAMA_70B, 139, 131072, 4)
    assert code == 0
    assert "327,680" in out
    assert f"{plan.kv_tokens_per_replica:,} tokens" in out
    assert f"{plan.max_full_context_requests:,} at full context" in out


def test_cli_json_output(capsys):
    """--json prints the plan as JSON with the same numbers."""
    code, out, _ = run_cli(["plan", "--layers", "80", "--kv-heads", "8", "--head-dim", "128", "--params-b", "70.6",
                            "--gpu-mem-gib", "139", "--tp", "4", "--max-model-len", "131072", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["kv_bytes_per_token"] == 327_680 and data["suggested_tensor_parallel_size"] == 4


@pytest.mark.parametrize("argv, words", [
    (["--layers", "80", "--gpu-mem-gib", "80", "--max-model-len", "4096"], "--kv-heads"),
    (["--layers", "80", "--kv-heads", "8", "--head-dim", "128", "--gpu-mem-gib", "80", "--max-model-len", "4096"],
     "--params-b"),
    (["--layers", "80", "--kv-heads", "8", "--head-dim", "128", "--dtype", "bf17", "--params-b", "1",
      "--gpu-mem-gib", "80", "--max-model-len", "4096"], "bf17"),
])
def test_cli_errors_say_what_to_pass(argv, words, capsys):
    """Missing or bad flags exit 2 with a message naming the flag or value to fix."""
    code, _, err = run_cli(["plan", *argv], capsys)
    assert code == 2 and words in err


def test_cli_missing_model_dir(tmp_path, capsys):
    """A --model path without config.json exits 2 and says what --model takes."""
    code, _, err = run_cli(["plan", "--model", str(tmp_path / "nope"), "--gpu-mem-gib", "80",
                            "--max-model-len", "4096"], capsys)
    assert code == 2 and "config.json" in err


def test_cli_reads_model_tp_context_and_kv_cache_dtype_from_a_kvtide_config(tmp_path, capsys):
    """`kvtide plan --config`: the model, TP size, context and engine.extra_args.kv_cache_dtype come from the
    config (fp8 KV halves the bytes per token of bf16); a flag given still wins."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B_CONFIG))
    config = tmp_path / "kvtide.yaml"
    config.write_text(f"model: {tmp_path}\nengine:\n  tensor_parallel_size: 4\n  max_model_len: 131072\n"
                      "  extra_args: {kv_cache_dtype: fp8}\nresources: {device: gpu}\n")
    code, out, _ = run_cli(["plan", "--config", str(config), "--gpu-mem-gib", "139", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["kv_bytes_per_token"] == 327_680 // 2 and data["tensor_parallel_size"] == 4
    code, out, _ = run_cli(["plan", "--config", str(config), "--gpu-mem-gib", "139", "--tp", "8", "--json"], capsys)
    assert code == 0 and json.loads(out)["tensor_parallel_size"] == 8


def test_the_cpu_tier_holds_its_gib_in_whole_blocks_beside_an_unchanged_gpu_kv():
    """--kv-offload-gib G holds G GiB ÷ (KV bytes per token × block size) whole blocks; GPU KV is unchanged."""
    without = plan_capacity(LLAMA_70B, 139, 131072, 4)
    plan = plan_capacity(LLAMA_70B, 139, 131072, 4, kv_offload_gib=400, block_size=32)
    blocks = 400 * GIB // (327_680 * 32)
    assert (plan.cpu_kv_bytes_per_replica, plan.cpu_kv_blocks_per_replica, plan.cpu_kv_tokens_per_replica) == (
        400 * GIB, blocks, blocks * 32)
    assert plan.kv_tokens_per_replica == without.kv_tokens_per_replica
    assert plan.kv_blocks_per_replica == plan.kv_tokens_per_replica // 32
    assert plan.total_kv_tokens_per_replica == plan.kv_tokens_per_replica + blocks * 32
    assert (without.cpu_kv_bytes_per_replica, without.total_kv_tokens_per_replica) == (0, without.kv_tokens_per_replica)


def test_the_cpu_tier_stores_a_replicated_kv_head_per_gpu_as_the_gpus_do():
    """With TP above the KV-head count a CPU-tier token takes as many bytes as on the GPUs: whole heads on each."""
    shape = ModelShape(num_layers=32, num_kv_heads=2, head_dim=128, dtype="bf16", num_params=1_000_000_000)
    tp2 = plan_capacity(shape, 80, 4096, 2, kv_offload_gib=16)
    tp4 = plan_capacity(shape, 80, 4096, 4, kv_offload_gib=16)
    assert tp2.cpu_kv_tokens_per_replica == 16 * GIB // (shape.kv_bytes_per_token * 16) * 16
    assert tp4.cpu_kv_blocks_per_replica == tp2.cpu_kv_blocks_per_replica // 2


def test_a_working_set_needs_fewer_replicas_with_the_cpu_tier_and_none_hold_it_without_kv():
    """Replicas for a working set: ceil over GPU KV, ceil over GPU + CPU with a tier; None when no KV fits."""
    plan = plan_capacity(LLAMA_70B, 139, 131072, 4, kv_offload_gib=400, working_set_tokens=50_000_000)
    assert plan.working_set_replicas_gpu == -(-50_000_000 // plan.kv_tokens_per_replica)
    assert plan.working_set_replicas == -(-50_000_000 // plan.total_kv_tokens_per_replica)
    assert plan.working_set_replicas < plan.working_set_replicas_gpu
    no_kv = plan_capacity(LLAMA_70B, 80, 8192, 1, kv_offload_gib=400, working_set_tokens=1000)
    assert (no_kv.working_set_replicas_gpu, no_kv.working_set_replicas, no_kv.total_kv_tokens_per_replica) == (
        None, None, 0)


SHAPE_FLAGS = ["--layers", "80", "--kv-heads", "8", "--head-dim", "128", "--params-b", "70.6", "--gpu-mem-gib", "139",
               "--tp", "4", "--max-model-len", "131072"]


def test_cli_adds_the_cpu_tier_lines_and_keeps_every_other_line(capsys):
    """--kv-offload-gib adds the tier, GPU + CPU (a hit is a load, not a recompute) and host memory lines; no other."""
    _, plain, _ = run_cli(["plan", *SHAPE_FLAGS], capsys)
    code, out, _ = run_cli(["plan", *SHAPE_FLAGS, "--kv-offload-gib", "400"], capsys)
    plan = plan_capacity(LLAMA_70B, 139, 131072, 4, kv_offload_gib=400)
    added = [line for line in out.splitlines() if line not in plain.splitlines()]
    assert code == 0 and [line for line in out.splitlines() if line in plain.splitlines()] == plain.splitlines()
    assert [line.split(":")[0] for line in added] == ["CPU KV tier per replica", "GPU + CPU KV per replica",
                                                      "host memory per replica"]
    assert f"{plan.cpu_kv_tokens_per_replica:,} tokens ({plan.cpu_kv_blocks_per_replica:,} blocks of 16)" in added[0]
    assert f"{plan.total_kv_tokens_per_replica:,} tokens" in added[1]
    assert "costs a load (host→GPU copy), not a recompute" in added[1]
    assert "400.0 GiB pinned for the tier" in added[2]


def test_cli_working_set_line_names_both_fleet_sizes(capsys):
    """--working-set-tokens prints the replicas holding it on GPU KV, and with a CPU tier on GPU + CPU as well."""
    code, out, _ = run_cli(["plan", *SHAPE_FLAGS, "--working-set-tokens", "50000000"], capsys)
    gpu = plan_capacity(LLAMA_70B, 139, 131072, 4, working_set_tokens=50_000_000).working_set_replicas_gpu
    assert code == 0 and f"working set of 50,000,000 tokens: {gpu:,} replicas hold it in GPU KV\n" in out
    code, out, _ = run_cli(["plan", *SHAPE_FLAGS, "--working-set-tokens", "50000000", "--kv-offload-gib", "400"],
                           capsys)
    both = plan_capacity(LLAMA_70B, 139, 131072, 4, kv_offload_gib=400, working_set_tokens=50_000_000)
    assert code == 0 and (f"{both.working_set_replicas:,} replicas hold it in GPU + CPU KV ({gpu:,} in GPU KV alone); "
                          "CPU-tier hits cost a load, not a recompute") in out


def test_cli_reads_the_cpu_tier_and_block_size_from_a_kvtide_config(tmp_path, capsys):
    """`kvtide plan --config`: engine.kv_offload.size_gib and engine.block_size size the CPU tier; flags still win."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B_CONFIG))
    config = tmp_path / "kvtide.yaml"
    config.write_text(f"model: {tmp_path}\nengine:\n  tensor_parallel_size: 4\n  max_model_len: 131072\n"
                      "  block_size: 32\n  kv_offload: {size_gib: 64}\nresources: {device: gpu}\n")
    code, out, _ = run_cli(["plan", "--config", str(config), "--gpu-mem-gib", "139", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and (data["cpu_kv_bytes_per_replica"], data["block_size"]) == (64 * GIB, 32)
    assert data["cpu_kv_blocks_per_replica"] == 64 * GIB // (327_680 * 32)
    code, out, _ = run_cli(["plan", "--config", str(config), "--gpu-mem-gib", "139", "--kv-offload-gib", "8",
                            "--block-size", "16", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and (data["cpu_kv_bytes_per_replica"], data["block_size"]) == (8 * GIB, 16)


@pytest.mark.parametrize("flags, words", [
    (["--kv-offload-gib", "0"], "--kv-offload-gib 0"),
    (["--block-size", "0"], "--block-size"),
    (["--working-set-tokens", "-5"], "--working-set-tokens -5"),
])
def test_cli_refuses_a_cpu_tier_block_size_or_working_set_below_one(flags, words, capsys):
    """A tier of 0 GiB, blocks of 0 tokens or a negative working set exit 2 naming the flag."""
    code, _, err = run_cli(["plan", *SHAPE_FLAGS, *flags], capsys)
    assert code == 2 and words in err


def test_cli_hands_a_planned_cpu_tier_to_the_simulator_and_says_so(monkeypatch, tmp_path, capsys):
    """`--trace` with a CPU tier: the simulator gets the tier's host bytes per replica, and the plan says it simulated it."""
    import kvtide.autoscaling.cli as cli

    seen = {}

    def planner(**kwargs):
        seen.update(kwargs)
        return {"policies": {"prefix_aware": {"replicas": 3}}}

    monkeypatch.setattr(cli, "trace_planner", lambda: planner)
    trace = ["--trace", str(tmp_path / "t.jsonl"), "--slo-ttft-p90-ms", "500"]
    code, out, _ = run_cli(["plan", *SHAPE_FLAGS, "--kv-offload-gib", "400", *trace], capsys)
    assert code == 0 and seen["kv_bytes_per_replica"] == plan_capacity(LLAMA_70B, 139, 131072, 4).kv_bytes_per_replica
    assert seen["cpu_kv_bytes_per_replica"] == 400 * 2**30
    assert "fleet on the trace:       simulated with the CPU tier" in out
    code, out, _ = run_cli(["plan", *SHAPE_FLAGS, "--kv-offload-gib", "400", *trace, "--json"], capsys)
    assert json.loads(out)["fleet"]["cpu_kv_tier"].startswith("simulated with the CPU tier")
    code, out, _ = run_cli(["plan", *SHAPE_FLAGS, *trace], capsys)
    assert "CPU tier" not in out.split("fleet for")[-1] and seen["cpu_kv_bytes_per_replica"] == 0
