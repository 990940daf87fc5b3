"""Fixtures shared by unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def demo_tokenizer(tmp_path_factory):
    """The demo model's own (byte-level BPE) fast tokenizer and chat template, from a tiny build of the demo
    checkpoint."""
    from transformers import AutoTokenizer

    from kvtide.deployments.engine.demo_model import DemoModelSpec, build_demo_model

    tiny = DemoModelSpec(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVTIDE_HOME", str(tmp_path_factory.mktemp("kvtide-home")))
        return AutoTokenizer.from_pretrained(build_demo_model(tiny))
