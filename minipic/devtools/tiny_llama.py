"""Build a tiny random Llama and a word-level tokenizer on disk, with no model hub.

Tests, the demo and CI use it: vLLM loads the directory like any HF model. The
tokenizer has Llama-3 style reserved special tokens, so minipic's default span
protocol resolves without configuration.
"""

from __future__ import annotations

import string
from pathlib import Path

NUM_RESERVED = 4
# A fixed vocabulary so token ids are stable across runs and machines.
WORDS = sorted({
    *string.ascii_lowercase,
    *"the of and to in is was for on that with as by at from it an be this which or are were".split(),
    *"paris france berlin germany rome italy madrid spain london england tokyo japan".split(),
    *"capital city river mountain king queen born died year war book author film".split(),
    *"document question answer system you helpful assistant read following what who where".split(),
    *"one two three four five six seven eight nine ten hundred thousand".split(),
    *(f"w{i}" for i in range(300)),
    *".,?!:;'\"()-0123456789",
})
SPECIALS = ["<unk>", "<s>", "</s>", *(f"<|reserved_special_token_{i}|>" for i in range(NUM_RESERVED))]


def build_tokenizer(path: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Punctuation()]
    )
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        additional_special_tokens=SPECIALS[3:],
    )
    fast.save_pretrained(path)
    return fast


def build_tiny_llama(path: str | Path, *, head_dim: int = 32, num_heads: int = 4,
                     num_kv_heads: int = 2, num_layers: int = 2, seed: int = 0,
                     rope_scaling: dict | None = None, max_position_embeddings: int = 4096,
                     **config_overrides) -> Path:
    """Write a random Llama (fp32) plus tokenizer into `path`; returns the path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=head_dim * num_heads,
        intermediate_size=4 * head_dim * num_heads, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
        max_position_embeddings=max_position_embeddings, rope_theta=10000.0, rope_scaling=rope_scaling,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32", tie_word_embeddings=False, **config_overrides,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Larger than default init so that attention patterns (and thus position
    # handling) visibly change the logits of this tiny model.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path, safe_serialization=True)
    return path


if __name__ == "__main__":
    import sys

    print(build_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tiny-llama"))
