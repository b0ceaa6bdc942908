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

from minipic.attention.host_copy import to_device
from minipic.attention.rope import current_rope
from minipic.attention.rotation import Rotation


def batch_metadata(layer) -> Any:
    """The batch's attention metadata for `layer` (vLLM's KV update op is handed none);
    None outside a forward (unit tests calling the KV update directly)."""
    from vllm import forward_context

    if not forward_context.is_forward_context_available():
        return None
    metadata = forward_context.get_forward_context().attn_metadata
    return metadata.get(layer.layer_name) if isinstance(metadata, dict) else metadata


def token_turns(amounts: torch.Tensor | None, device: torch.device) -> Rotation | None:
    """The rotation turning the batch's first len(amounts) tokens back by their amounts,
    looked up once per batch for all layers; None when `amounts` is None (nothing turns)."""
    if amounts is None:
        return None
    rope = current_rope()
    return Rotation.back(to_device(amounts, device), rope.cos_sin(device),
                         rope.rotary_dim, rope.is_neox_style)


def turn_back_tokens(x: torch.Tensor, turns: Rotation | None) -> torch.Tensor:
    """Q or K [tokens, ...] of the batch with its first len(turns) tokens turned back
    (token_turns; rows past them are padding and pass as they are).

    `turns` None means nothing to turn: `x` itself, no work."""
    if turns is None:
        return x
    n = turns.cos.shape[0]
    heads = x[:n].view(n, -1, current_rope().head_size)
    if x.is_cuda:  # one launch, where torch takes a dozen per layer
        from minipic.attention.segment_kernels import turn_rows

        turned = turn_rows(heads, None, turns.cos, turns.sin, turns.rotary_dim,
                           turns.is_neox_style)
    else:
        turned = turns.apply(heads).to(x.dtype)
    if n == x.shape[0]:
        return turned.view(x.shape)
    return torch.cat((turned.view(n, *x.shape[1:]), x[n:]))
