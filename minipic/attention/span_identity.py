"""Worker side (Model Runner V2): which span blocks of a batch hold the same keys.

An SSep block's KV depends only on the tokens from its span's SSep block through
itself, and is stored in the span's frame (span_layout.py). Two requests whose spans
hold the same tokens there read the same keys, wherever the spans sit in their
prompts; so a batch whose requests share documents reads each shared span tail once
for all their queries (segment_plan.py), as vLLM's cascade attention reads a shared
prefix once.

Blocks are told apart by a 128-bit BLAKE2b chain over their span's tokens: spans
that differ never share an id, even when a client crafts them to. A request whose KV
depends on more than its tokens (a LoRA adapter, multimodal inputs, prompt embeddings)
and a request with a cache_salt (its tenant's isolation: sharing would tell in the step
time that another request holds the same document) get no ids (host_prompts.py,
_vllm_patches._note_host_prompts). The ids are integers,
one per distinct chain among the running prompts; the table drops a chain when no
running prompt holds it, so it is as large as the running batch, not the traffic.
"""

from __future__ import annotations

import hashlib

import numpy as np

# A block outside SSep spans (or a span's partial last block): no id, never shared.
NO_ID = -1


class SpanIds:
    """Reference-counted ids of span block chains."""

    def __init__(self) -> None:
        self._ids: dict[bytes, list[int]] = {}  # chain -> [id, prompts holding it]
        self._next = 0

    def take(self, prompt: np.ndarray, block_size: int, ssep: int,
             markers: frozenset[int]) -> tuple[np.ndarray, list[bytes]]:
        """Per block of `prompt`, the id of its chain (NO_ID outside SSep spans), and
        the chains taken (give them back with `release`).

        A span runs from an SSep block to the next marker block (span_layout's rule);
        markers count at block starts of the prompt only, as in the block hasher."""
        firsts = prompt[::block_size].tolist()
        ids = np.full(len(firsts), NO_ID, dtype=np.int64)
        data, width = prompt.astype(np.int64).tobytes(), 8 * block_size
        full_blocks = prompt.size // block_size  # a partial last block holds queries only
        chains, chain = [], None
        for block, first in enumerate(firsts[:full_blocks]):
            if first in markers:
                chain = b"" if first == ssep else None
            if chain is None:
                continue
            chain = hashlib.blake2b(chain + data[block * width: (block + 1) * width],
                                    digest_size=16).digest()
            ids[block] = self._hold(chain)
            chains.append(chain)
        return ids, chains

    def release(self, chains: list[bytes]) -> None:
        for chain in chains:
            entry = self._ids[chain]
            entry[1] -= 1
            if entry[1] == 0:
                del self._ids[chain]

    def __len__(self) -> int:
        return len(self._ids)

    def _hold(self, chain: bytes) -> int:
        entry = self._ids.get(chain)
        if entry is None:
            entry = self._ids[chain] = [self._next, 0]
            self._next += 1
        entry[1] += 1
        return entry[0]
