"""Build a random-weight Llama-3.1-8B-shaped checkpoint on the GPU machine (no model hub there).

    python3 benchmarks/h200/build_model.py /tmp/models/llama-8b-shape

The shape is Llama-3.1-8B's (32 layers, 4096 hidden, 32/8 GQA heads, 14336 MLP, 128k vocab,
bf16): the KV bytes per token and the FLOPs per token are the real ones, so prefill and
decode cost what they would. The tokenizer is kvtide's demo tokenizer (8k BPE), whose ids
fit the larger vocabulary; the weights are random, so the text is gibberish (benchmarks
force output lengths with ignore_eos).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def main(target: str) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvtide.deployments.engine.demo_model import build_demo_model

    out = Path(target)
    if (out / "config.json").is_file():
        print(out)
        return 0
    config = LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    staging = out.with_name(out.name + ".partial")
    model.save_pretrained(staging, safe_serialization=True)
    demo = build_demo_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (demo / name).is_file():
            shutil.copy(demo / name, staging / name)
    staging.rename(out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
