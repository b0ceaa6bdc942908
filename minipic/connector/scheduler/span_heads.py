"""Which offload keys start a span, so the store can count spans.

The disk tier only sees keys; the connector sees the tokens. For every new
request it records the keys of blocks that begin with SSep, and the tier sets
a flag in those blocks' headers. Bounded: old entries fall out first (a
missing flag only makes `minipic store stats` undercount spans).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from vllm.v1.kv_offload.base import OffloadKey, make_offload_key

from minipic.connector.scheduler.bounded_keys import BoundedKeys


class SpanHeads(BoundedKeys):
    def __init__(self, capacity: int = 1 << 20):
        super().__init__(capacity)


def span_head_keys(token_ids: Sequence[int], block_hashes: Sequence[Any], block_size: int,
                   ssep_token_id: int, group_ids: Iterable[int] = (0,)) -> list[OffloadKey]:
    """Keys (for every offloaded KV group) of the full blocks that start with SSep."""
    groups = tuple(group_ids)
    # every block's first token by one slice (a request's tokens are a vLLM ConstantList,
    # whose per-item reads cost a call each); zip stops at the shorter of the two
    firsts = token_ids[::block_size]
    return [make_offload_key(bytes(h), g)
            for first, h in zip(firsts, block_hashes) if first == ssep_token_id
            for g in groups]
