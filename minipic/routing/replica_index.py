"""Router side: which blocks each replica holds, from its KV events, and how many
tokens of a span prompt it would serve from cache.

Keys are the engine's block hashes as published, never hashes a router derives
from `token_ids` and `parent_block_hash`: under minipic an SSep block's hash does
not depend on its parent, and the parent an event names is the block before it
in the request that stored it, which differs from one offset to another.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any, Iterable, Sequence

from minipic.routing.span_hashes import SpanHashes


def decode_event_batch(payload: bytes) -> Any:
    """One ZMQ message's payload (its third frame) as vLLM's KVEventBatch."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    return msgspec.msgpack.decode(payload, type=KVEventBatch)


@dataclasses.dataclass(frozen=True)
class ReplicaScore:
    """`hit_tokens`: what vLLM would report as num_cached_tokens (the longest run
    of held blocks from block 0, the last prompt token always computed).
    `held_tokens`: tokens of every held block of the prompt, wherever the run
    breaks (spans the replica would not have to prefill again)."""

    hit_tokens: int
    held_tokens: int


class ReplicaIndex:
    """Per replica, the block hashes it holds and in which media (GPU, CPU, ...)."""

    def __init__(self) -> None:
        self._held: dict[str, dict[Any, set]] = defaultdict(lambda: defaultdict(set))

    def apply(self, replica: str, events: Iterable[Any]) -> None:
        """Apply a replica's events (a KVEventBatch's `.events`) in order."""
        held = self._held[replica]
        for event in events:
            name = type(event).__name__
            if name == "AllBlocksCleared":
                held.clear()
            elif name == "BlockStored":
                for h in event.block_hashes:
                    held[h].add(event.medium)
            elif name == "BlockRemoved":
                for h in event.block_hashes:
                    held[h].discard(event.medium)
                    if not held[h]:
                        del held[h]

    def holds(self, replica: str, block_hash: Any) -> bool:
        return block_hash in self._held.get(replica, {})

    def score(self, replica: str, spans: Sequence[SpanHashes]) -> ReplicaScore:
        """How much of the prompt `spans` (from span_block_hashes) `replica` holds."""
        if not spans:
            return ReplicaScore(0, 0)
        block_size = spans[0].block_size
        present = [self.holds(replica, h) for span in spans for h in span.block_hashes]
        # vLLM computes the last prompt token for its logits: a block-aligned prompt
        # recomputes its last block.
        max_hit_blocks = (spans[-1].end - 1) // block_size
        hit_blocks = next((i for i, p in enumerate(present[:max_hit_blocks]) if not p),
                          min(len(present), max_hit_blocks))
        return ReplicaScore(hit_blocks * block_size, sum(present) * block_size)

    def rank(self, spans: Sequence[SpanHashes]) -> list[tuple[str, ReplicaScore]]:
        """Replicas, best first: most tokens hit, then most held."""
        scores = [(r, self.score(r, spans)) for r in self._held]
        return sorted(scores, key=lambda rs: (rs[1].hit_tokens, rs[1].held_tokens), reverse=True)

