"""Llama-3.1-8B's architecture for GPU tests and benchmarks (dummy weights, no model hub)."""

from __future__ import annotations

import json
from pathlib import Path

# llama3 RoPE scaling: the scaled cos/sin table real deployments use.
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "vocab_size": 128256,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 128000, "eos_token_id": 128001,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}
# Llama-3's reserved special tokens, named explicitly: a dummy model has no tokenizer.
MARKERS = {"ssep_token_id": 128002, "pdep_token_id": 128003, "pad_token_id": 128004,
           "link_token_id": 128005}


def write_config(directory: str | Path) -> Path:
    """A model directory vLLM loads with load_format="dummy"."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG))
    return path
