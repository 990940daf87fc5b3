"""Prompt text → token ids, the ids the served model's Hugging Face tokenizer computes, at less cost.

Why: the routing peer tokenizes every POST before HAProxy may forward it, so tokenizing is on
every request's TTFT. transformers' `tokenizer.encode(text)` calls the Rust tokenizer's
`encode_batch`, which also builds each token's string, offsets and masks for Python; the
Rust `encode_batch_fast` (tokenizers >= 0.21) skips the offsets and returns the same ids,
so it does less work per token on every request's path.

The fast call is taken only where it gives transformers' ids: a Rust-backed tokenizer whose
backend has no truncation or padding set and splits special tokens as transformers would
(`split_special_tokens`), and which agreed with `encode` on a probe text when it was built.
Anywhere else it is `tokenizer.encode`.
"""

from __future__ import annotations

from typing import Any

# Special tokens, a chat-template shape, non-ASCII and runs of spaces: where tokenizers differ first.
_PROBE_TEXTS = ("Hello world", "  two  spaces\n\nand\ttabs ", "naïve café 東京 🙂", "<s>[INST] hi [/INST]</s>",
                "<|user|>\nhi<|end|>\n<|assistant|>\n")


class TokenEncoder:
    """`encoder(text, add_special_tokens)` → the token ids of `tokenizer.encode(text, add_special_tokens=...)`."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "_tokenizer", None)
        self._backend = backend if hasattr(backend, "encode_batch_fast") else None
        if self._backend is not None and not all(
                self._fast(text, special) == list(tokenizer.encode(text, add_special_tokens=special))
                for text in _PROBE_TEXTS for special in (True, False)):
            self._backend = None

    @property
    def fast(self) -> bool:
        """Whether the Rust fast path is in use (else `tokenizer.encode`)."""
        return self._backend is not None

    def __call__(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._backend is not None and self._backend_as_transformers_sets_it():
            return self._fast(text, add_special_tokens)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _fast(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def _backend_as_transformers_sets_it(self) -> bool:
        # transformers clears truncation and padding before every plain encode and sets
        # encode_special_tokens from split_special_tokens; a backend left otherwise (another
        # caller set truncation on a shared tokenizer) would give other ids.
        backend = self._backend
        return (backend.truncation is None and backend.padding is None
                and backend.encode_special_tokens == bool(getattr(self.tokenizer, "split_special_tokens", False)))
