"""A random-weight model of the default model's shape that splits over 2 ranks, for `aerie bench
--tp-verify 2` (SmolLM2-135M has 9 attention heads and 3 KV heads: it splits over 3 ranks, not 2).

    .venv/bin/python bench/tp_shape_model.py OUT_DIR

Same hidden size (576), MLP (1536), 30 layers, tied 49152-token vocabulary and tokenizer as
SmolLM2-135M-Instruct, but 8 heads of 72 and 2 KV heads. Random weights: for latency only.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from services.model.loading import converted_gguf_dir, find_default_gguf


def main(out: str) -> None:
    src = converted_gguf_dir(Path(find_default_gguf()))
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=72, max_position_embeddings=8192,
                      tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / name).is_file():
            shutil.copy(src / name, Path(out) / name)


if __name__ == "__main__":
    main(sys.argv[1])
