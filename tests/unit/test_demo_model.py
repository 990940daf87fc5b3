"""The demo checkpoint: built locally, deterministic, loadable, with a working chat template."""

from __future__ import annotations

import hashlib
import json

import pytest

from kvtide.deployments.engine.demo_model import DemoModelSpec, build_demo_model

# A much smaller spec keeps this test fast; determinism does not depend on size.
TINY = DemoModelSpec(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)


def _digest(path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir()) if f.is_file()}


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIDE_HOME", str(tmp_path))
    return tmp_path


def test_two_builds_are_byte_identical(home, tmp_path_factory, monkeypatch):
    """Building twice from scratch (same seed) gives byte-identical weights and tokenizer."""
    first = _digest(build_demo_model(TINY))
    monkeypatch.setenv("KVTIDE_HOME", str(tmp_path_factory.mktemp("again")))
    second = _digest(build_demo_model(TINY))
    assert first == second
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= set(first)


def test_build_is_cached(home):
    """A second call reuses the cached directory instead of rebuilding."""
    path = build_demo_model(TINY)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert build_demo_model(TINY) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


def test_checkpoint_is_llama_with_chat_template(home):
    """config.json declares Llama; the tokenizer renders chat turns and ends turns with <|end|>."""
    from transformers import AutoTokenizer

    path = build_demo_model(TINY)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 2
    tok = AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<s><|user|>\nhi<|end|>\n<|assistant|>\n"
    assert tok.convert_tokens_to_ids("<|end|>") in config["eos_token_id"]


def test_default_spec_fingerprint_changes_with_shape():
    """Changing the architecture changes the cache directory, so stale builds are never reused."""
    assert DemoModelSpec().fingerprint != TINY.fingerprint
