"""Worker side (Model Runner V2): which span blocks of a batch hold the same keys.

An SSep block's KV depends only on the tokens from its span's SSep block through
itself, and is stored in the span's frame (span_layout.py). Two requests whose spans
hold the same tokens there read the same keys, wherever the spans sit in their
prompts; so a batch whose requests share documents reads each shared span tail once
for all their queries (segment_plan.py), as vLLM's cascade attention reads a shared
prefix once.

A span is told apart by a 128-bit BLAKE2b digest of its tokens (its full blocks, from
its SSep block to the next marker block): spans that differ never share an id, even
when a client crafts them to, and a block's id is its span's first id plus its place
in the span, so the same document gets the same ids wherever it sits. One digest a
span, not a chain of digests a block: a step may add hundreds of prompts (ISPS at
repeat rate 0.9: about 180 of 66 blocks each), all hashed on the step's host time.
Two spans that share their first blocks but not their last share nothing, which only
costs a read; so does a span at its prompt's end, which gets no ids (only its own
queries read it). A request whose KV depends on more than its tokens (a LoRA adapter,
multimodal inputs, prompt embeddings) and a request with a cache_salt (its tenant's
isolation: sharing would tell in the step time that another request holds the same
document) get no ids (host_prompts.py, _vllm_patches._note_host_prompts). The table
drops a span when no running prompt holds it, so it is as large as the running batch,
not the traffic.
"""

from __future__ import annotations

import hashlib

import numpy as np

# A block outside SSep spans, or in a span no other row reads: no id, never shared.
NO_ID = -1


class SpanIds:
    """Reference-counted id ranges of spans."""

    def __init__(self) -> None:
        # (block_size, digest) -> [first id, prompts holding it]; the span's blocks take
        # the ids from its first on (the digest fixes how many)
        self._spans: dict[tuple[int, bytes], list[int]] = {}
        self._next = 0

    def take(self, prompt: np.ndarray, block_size: int, ssep: int,
             markers: frozenset[int]) -> tuple[np.ndarray, list[tuple[int, bytes]]]:
        """Per block of `prompt`, its span's first id plus its place in the span (NO_ID
        outside SSep spans), and the spans taken (give them back with `release`).

        A span runs from an SSep block to the next marker block (span_layout's rule);
        markers count at block starts of the prompt only, as in the block hasher. A span
        at the prompt's end gets no id."""
        blocks = -(-prompt.size // block_size)
        ids = np.full(blocks, NO_ID, dtype=np.int64)
        firsts = prompt[::block_size]  # a partial last block's too: its marker counts
        is_marker = np.zeros(blocks, dtype=bool)
        for marker in markers:  # three or four: cheaper than np.isin
            is_marker |= firsts == marker
        marker_blocks = np.flatnonzero(is_marker)
        # The last marker's segment runs to the prompt's end. A span there (a span prefilled
        # alone) is read by its own queries only, generated tokens included (they extend
        # it): no other row reads it, so it needs no id (ISPS adds as many such prompts as
        # final ones). Every other span ends at a marker block, so its blocks are full.
        starts, ends = marker_blocks[:-1], marker_blocks[1:]
        is_span = firsts[starts] == ssep
        starts, ends = starts[is_span], ends[is_span]
        if starts.size == 0:
            return ids, []
        data = memoryview(np.ascontiguousarray(prompt, dtype=np.int64)).cast("B")
        width = 8 * block_size
        spans = [(block_size, hashlib.blake2b(data[start * width: end * width],
                                              digest_size=16).digest())
                 for start, end in zip(starts.tolist(), ends.tolist())]
        counts = ends - starts
        first_ids = np.array([self._hold(span, count)
                              for span, count in zip(spans, counts.tolist())], dtype=np.int64)
        # each span's blocks: its first id plus the block's place in the span
        place = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        ids[np.repeat(starts, counts) + place] = np.repeat(first_ids, counts) + place
        return ids, spans

    def release(self, spans: list[tuple[int, bytes]]) -> None:
        for span in spans:
            entry = self._spans[span]
            entry[1] -= 1
            if entry[1] == 0:
                del self._spans[span]

    def __len__(self) -> int:
        """How many distinct spans the running prompts hold."""
        return len(self._spans)

    def _hold(self, span: tuple[int, bytes], blocks: int) -> int:
        entry = self._spans.get(span)
        if entry is None:
            entry = self._spans[span] = [self._next, 0]
            self._next += blocks
        entry[1] += 1
        return entry[0]
