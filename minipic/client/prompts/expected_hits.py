"""How many tokens of a final prompt vLLM should serve from cache after the prefills.

Rather than hand-counting per recipe, replay the engine's own hashing rules
(minipic's SpanBlockHasher, with a local hash function: only equality matters)
over the prefills and the final prompt, then apply vLLM's hit rules:
  * only full blocks are cached;
  * a hit is the longest run of cached blocks from block 0 (the first miss ends it);
  * at most num_tokens - 1 tokens hit, because the last prompt token must be
    computed for logits; a block-aligned fully cached prompt recomputes its last block.
Extra keys (LoRA, multimodal, cache_salt) are assumed equal across requests.
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any, Sequence

from minipic.hashing.block_hasher import SpanBlockHasher
from minipic.protocol import SpanProtocol


def _hash(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj)).digest()


def _hash_block_tokens(hash_fn, parent: bytes, tokens: Sequence[int], extra_keys) -> bytes:
    return hash_fn((parent, tuple(tokens), extra_keys))  # vLLM's hash_block_tokens layout


def block_hashes(tokens: Sequence[int], protocol: SpanProtocol, block_size: int) -> list[bytes]:
    """One hash per full block, by the engine's SSep/PDep/chain rules."""
    hasher = SpanBlockHasher(protocol, _hash, _hash_block_tokens, seed=_hash("seed"))
    hashes: list[bytes] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start:start + block_size]
        hashes.append(hasher.hash_block(block, hashes, None, None))
    return hashes


def expected_cached_tokens(final: Sequence[int], prefills: Sequence[Sequence[int]],
                           protocol: SpanProtocol, block_size: int) -> int:
    cached = {h for p in prefills for h in block_hashes(p, protocol, block_size)}
    max_hit_blocks = (len(final) - 1) // block_size if final else 0
    hit_blocks = 0
    for h in block_hashes(final, protocol, block_size)[:max_hit_blocks]:
        if h not in cached:
            break
        hit_blocks += 1
    return hit_blocks * block_size
