"""TokenEncoder: the Rust fast path gives exactly the ids of `tokenizer.encode`, and steps aside where it would not."""

from __future__ import annotations

import pytest

from fakes import FakeTokenizer

from kvtide.deployments.frontend.token_encoder import TokenEncoder

TEXTS = ["", "hello world", "  two  spaces\n\n", "naïve café 東京 🙂", "<s>[INST] hi [/INST]</s>",
         "alpha beta " * 300, "x" * 5000]


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_fast_path_ids_equal_transformers_encode(demo_tokenizer, add_special_tokens):
    """On the demo model's fast tokenizer the fast path is taken and every text gives `encode`'s ids."""
    encoder = TokenEncoder(demo_tokenizer)
    assert encoder.fast
    for text in TEXTS:
        assert encoder(text, add_special_tokens) == demo_tokenizer.encode(text, add_special_tokens=add_special_tokens)


def test_a_backend_with_truncation_set_falls_back_to_encode(demo_tokenizer):
    """A backend left with truncation (another caller set it) would cut the ids: then `encode` is called instead."""
    encoder = TokenEncoder(demo_tokenizer)
    backend = demo_tokenizer._tokenizer
    backend.enable_truncation(max_length=4)
    try:
        calls = []
        real_encode = demo_tokenizer.encode

        def spy(text, add_special_tokens):
            calls.append(text)
            return real_encode(text, add_special_tokens=add_special_tokens)

        demo_tokenizer.encode = spy
        try:
            ids = encoder("alpha beta gamma delta epsilon zeta", False)
        finally:
            del demo_tokenizer.encode
        assert calls == ["alpha beta gamma delta epsilon zeta"] and len(ids) == len(real_encode(calls[0]))
    finally:
        backend.no_truncation()


def test_a_tokenizer_without_a_rust_backend_uses_encode():
    """A slow (pure Python) tokenizer has no fast path: its own `encode` gives the ids."""
    tokenizer = FakeTokenizer()
    encoder = TokenEncoder(tokenizer)
    assert not encoder.fast
    assert encoder("abc", True) == tokenizer.encode("abc", add_special_tokens=True)


def test_a_backend_that_disagrees_on_the_probe_texts_is_not_used(demo_tokenizer):
    """Should the fast call ever give other ids than `encode` (a tokenizer with Python-side steps), it is not used."""

    class Wrapped:
        _tokenizer = demo_tokenizer._tokenizer
        split_special_tokens = False

        def encode(self, text, add_special_tokens=True):  # a Python-side step the backend does not know
            return [7] + demo_tokenizer.encode(text, add_special_tokens=add_special_tokens)

    encoder = TokenEncoder(Wrapped())
    assert not encoder.fast and encoder("hi", False)[0] == 7
