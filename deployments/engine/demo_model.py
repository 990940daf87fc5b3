"""The demo model: a small Llama-architecture checkpoint built locally, no model hub.

Why it exists: kvtide's tests and `make serve` need a real vLLM engine on a real model,
and no hub is reachable here. The checkpoint is random-weight (its text is gibberish),
but its architecture, tokenizer and chat template are real, so vLLM runs it exactly as
it runs Llama: paged KV cache, prefix caching, chunked prefill, tensor parallelism.

Sizing: a 2,048-token prefill must cost clearly more than a routing decision plus the
HTTP hop (the prefix-aware router's win is skipped prefill), while an engine still
starts in well under 30 s on a 2-core CPU. 6 layers × 256 hidden, GQA 4/2 heads,
vocab 8,192: ~6 M parameters, a 2,048-token prefill costs ~0.2 s on one core.

Determinism: the tokenizer is trained on Python's own language reference text
(`pydoc_data.topics`, shipped with CPython) and weights come from a fixed seed, so two
builds on the same Python/torch give byte-identical files. The build is cached under
`$KVTIDE_HOME/models/<name>` (default `~/.cache/kvtide`) and written atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

DEMO_SPEC_VERSION = 1


@dataclass(frozen=True)
class DemoModelSpec:
    """Shape of the demo checkpoint; changing any field changes the cache directory."""

    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 8192
    seed: int = 0
    dtype: str = "bfloat16"

    @property
    def fingerprint(self) -> str:
        raw = json.dumps({"v": DEMO_SPEC_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(raw.encode()).hexdigest()[:12]


SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

# ChatML-like: each turn is "<|role|>\n{content}<|end|>\n"; generation starts after
# "<|assistant|>\n" and ends at <|end|> (an EOS id in generation_config).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}"
    "{{ '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def kvtide_home() -> Path:
    return Path(os.environ.get("KVTIDE_HOME", Path.home() / ".cache" / "kvtide"))


def demo_model_dir(spec: DemoModelSpec = DemoModelSpec()) -> Path:
    return kvtide_home() / "models" / f"kvtide-demo-{spec.fingerprint}"


def _corpus() -> list[str]:
    """Local English+code text: CPython's language reference topics, in a fixed order."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def _build_tokenizer(spec: DemoModelSpec, out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
        model_max_length=spec.max_position_embeddings,
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(out_dir)


def _build_weights(spec: DemoModelSpec, out_dir: Path, tokenizer_dir: Path) -> None:
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    end_id = tokenizer.convert_tokens_to_ids("<|end|>")
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, end_id],
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(getattr(torch, spec.dtype))
    model.save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, end_id],
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(out_dir)


def build_demo_model(spec: DemoModelSpec = DemoModelSpec(), force: bool = False) -> Path:
    """Build (or reuse) the demo checkpoint and return its directory."""
    target = demo_model_dir(spec)
    if (target / "config.json").is_file() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    def build(staging: Path) -> None:
        _build_tokenizer(spec, staging)
        _build_weights(spec, staging, staging)
        (staging / "kvtide-demo.json").write_text(json.dumps(asdict(spec), indent=2, sort_keys=True) + "\n")

    return _build_atomically(target, "config.json", build)


def _build_atomically(target: Path, marker: str, build: Callable[[Path], None]) -> Path:
    """`build` into a staging directory beside `target`, then rename it there (`marker`: a file a finished build has).

    Built next to the target and renamed: a crash never leaves a half-written build that later
    runs would mistake for a finished one.
    """
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        build(staging)
        if target.exists():
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:
            # Another process finished the same deterministic build first: use it.
            if not (target / marker).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_model(model: str) -> str:
    """'demo' → the built demo directory (building it if needed); anything else unchanged."""
    from kvtide.config import DEMO_MODEL

    if model == DEMO_MODEL:
        return str(build_demo_model())
    return model


# The demo LoRA adapters: random rank-8 adapters of the demo model's attention projections,
# one per name (seeded by it), for multi-LoRA serving and adapter routing without a hub.
DEMO_LORA_RANK = 8
DEMO_LORA_TARGETS = ("q_proj", "v_proj")


def demo_lora_dir(name: str, spec: DemoModelSpec = DemoModelSpec()) -> Path:
    return kvtide_home() / "loras" / f"{name}-{spec.fingerprint}"


def build_demo_lora(name: str, spec: DemoModelSpec = DemoModelSpec()) -> Path:
    """Build (or reuse) the random demo adapter `name` (PEFT's file layout) and return its directory."""
    import torch
    from safetensors.torch import save_file

    target = demo_lora_dir(name, spec)
    if (target / "adapter_config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    head_dim = spec.hidden_size // spec.num_attention_heads
    out_features = {"q_proj": spec.hidden_size, "v_proj": spec.num_key_value_heads * head_dim}
    generator = torch.Generator().manual_seed(int(hashlib.sha256(name.encode()).hexdigest()[:8], 16))
    tensors = {}
    for layer in range(spec.num_hidden_layers):
        for module in DEMO_LORA_TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(
                DEMO_LORA_RANK, spec.hidden_size, generator=generator).to(getattr(torch, spec.dtype)) * 0.1
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(
                out_features[module], DEMO_LORA_RANK, generator=generator).to(getattr(torch, spec.dtype)) * 0.1
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": DEMO_LORA_RANK, "lora_alpha": 2 * DEMO_LORA_RANK,
              "lora_dropout": 0.0, "bias": "none", "target_modules": list(DEMO_LORA_TARGETS),
              "base_model_name_or_path": str(demo_model_dir(spec)), "fan_in_fan_out": False}

    def build(staging: Path) -> None:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(staging / "adapter_model.safetensors"))
        (staging / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    return _build_atomically(target, "adapter_config.json", build)


def lora_modules(adapters: dict[str, str]) -> list[str]:
    """lora.adapters as vLLM's `--lora-modules` values (name=path), a 'demo' path built here first."""
    from kvtide.config.lora import DEMO_ADAPTER

    return [f"{name}={build_demo_lora(name) if path == DEMO_ADAPTER else path}" for name, path in adapters.items()]
