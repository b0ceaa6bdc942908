"""Worker side: turning queries and keys back by per-token amounts (both backends).

The model hands attention Q and K rotated at each token's index i (stock RoPE).
minipic moves them with the same rotation, by -amount per token:
  * Q of an EPIC link token by its link shift, to its logical position
    (span_layout.SpanLayout.shift);
  * K, before the cache write, by frame_offset + shift, into the frame it is
    stored in (SpanLayout.frame_offset): a span's keys relative to its start, so
    that a cached span is right wherever it sits.
One implementation, so the torch and Triton backends cannot drift.
"""

from __future__ import annotations

from typing import Any

import torch

from minipic.attention.rope import current_rope
from minipic.attention.rotation import turn_back


def batch_metadata(layer) -> Any:
    """The batch's attention metadata for `layer` (vLLM's KV update op is handed none);
    None outside a forward (unit tests calling the KV update directly)."""
    from vllm import forward_context

    if not forward_context.is_forward_context_available():
        return None
    metadata = forward_context.get_forward_context().attn_metadata
    return metadata.get(layer.layer_name) if isinstance(metadata, dict) else metadata


def turn_back_tokens(x: torch.Tensor, amounts: torch.Tensor | None) -> torch.Tensor:
    """Q or K [tokens, ...] of the batch with its first len(amounts) tokens turned
    back by their amounts (rows past them are padding and pass as they are).

    `amounts` None means nothing to turn: `x` itself, no work."""
    if amounts is None:
        return x
    rope = current_rope()
    n = amounts.shape[0]
    heads = x[:n].view(n, -1, rope.head_size)
    turned = turn_back(heads, amounts.to(x.device), rope.cos_sin(x.device),
                       rope.rotary_dim, rope.is_neox_style).to(x.dtype)
    return torch.cat((turned.view(n, *x.shape[1:]), x[n:]))
