"""Worker side: EPIC link tokens turned back to their logical positions (both backends).

A link token sits at physical index i but stands at logical position i - shift
(span_layout.SpanLayout). The model hands attention Q rotated at i and K unrotated;
turning both back by the shift (a rotation by -shift) puts Q at its logical
position and leaves K "unrotated at i minus the shift", so attention can keep
rotating every key by its physical index and the scores come out at logical
distances. One implementation, so the torch and Triton backends cannot drift.
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


def turn_back_links(x: torch.Tensor, token_shift: torch.Tensor | None) -> torch.Tensor:
    """Q or K [tokens, ...] of the batch with its first len(token_shift) tokens turned
    back by their shifts (rows past them are padding and pass as they are).

    `token_shift` None means no link in the batch: `x` itself, no work."""
    if token_shift is None:
        return x
    rope = current_rope()
    n = token_shift.shape[0]
    heads = x[:n].view(n, -1, rope.head_size)
    turned = turn_back(heads, token_shift.to(x.device), rope.cos_sin(x.device),
                       rope.rotary_dim, rope.is_neox_style).to(x.dtype)
    return torch.cat((turned.view(n, *x.shape[1:]), x[n:]))
