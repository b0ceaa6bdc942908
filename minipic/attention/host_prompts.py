"""Worker side: each running request's prompt on the host, for Model Runner V2.

MRV2 keeps token ids where the GPU reads them; reading them back to build a batch's
span layout waits for the GPU at every step (and with vLLM's asynchronous scheduling
stops the host from preparing a step while the previous one runs). Markers count in
prompts only (the hasher's rule), so the layout needs nothing but the prompts, kept
here from when the runner adds a request (a resumed request, or one whose streamed
input grew, is added again) until it removes it (finished or preempted).
"""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from minipic.attention.span_identity import NO_ID, SpanIds
from minipic.protocol import SpanProtocol


class HostPrompts:
    """Prompt token ids by the runner's request row (req_states' index), with each
    prompt's block first tokens and span block ids (span_identity.py) per block size."""

    def __init__(self, protocol: SpanProtocol) -> None:
        self._protocol = protocol
        # Token lists, not arrays: an array of a 40k-token prompt cost a millisecond of a
        # hit's only step; made once something needs one (span ids, decode needs). Copied:
        # the runner shares the scheduler's list, which a streamed input extends in place.
        self._prompts: dict[int, list[int]] = {}
        self._arrays: dict[int, np.ndarray] = {}
        self._shareable: dict[int, bool] = {}
        self._firsts: dict[tuple[int, int], np.ndarray] = {}  # (row, block_size) -> ids
        # (row, block_size) -> (span id of each block, the chains it holds)
        self._ids: dict[tuple[int, int], tuple[np.ndarray, list[bytes]]] = {}
        self._derived: dict[tuple[int, object], object] = {}  # (row, key) -> derived()
        self.span_ids = SpanIds()
        self.generation = 0  # how many prompts were added: a layout cache's key

    def add(self, row: int, prompt: Iterable[int], shareable: bool = True) -> None:
        """Request row `row` now runs `prompt` (replacing whatever ran there before).

        `shareable` False: its KV depends on more than its tokens (a LoRA adapter,
        multimodal inputs, prompt embeddings), so its spans get no ids: never shared."""
        self._forget(row)
        self._prompts[row] = list(prompt)
        self._shareable[row] = shareable
        self.generation += 1  # layouts built from the rows before are stale

    def _forget(self, row: int) -> None:
        """Drop what was derived from row `row`'s prompt, its span ids given back."""
        self._arrays.pop(row, None)
        for key in [k for k in self._firsts if k[0] == row]:
            del self._firsts[key]
        for key in [k for k in self._ids if k[0] == row]:
            self.span_ids.release(self._ids.pop(key)[1])
        for key in [k for k in self._derived if k[0] == row]:
            del self._derived[key]

    def remove(self, row: int) -> None:
        """Request row `row` runs nothing now: its prompt and span ids go."""
        self._prompts.pop(row, None)
        self._shareable.pop(row, None)
        self._forget(row)
        self.generation += 1

    def __len__(self) -> int:
        return len(self._prompts)

    def holds(self, rows: np.ndarray) -> bool:
        """Whether every row runs a prompt this copy holds (a dummy batch after serving
        names rows of requests that have finished)."""
        return all(row in self._prompts for row in rows.tolist())

    def derived(self, row: int, key: object, compute: Callable[[np.ndarray], object]) -> object:
        """compute(row's prompt), computed once while the row runs that prompt."""
        found = self._derived.get((row, key))
        if found is None:
            found = self._derived[(row, key)] = compute(self._array(row))
        return found

    def blocks(self, rows: np.ndarray, block_size: int, blocks: int, span_ids: bool = True
               ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """[len(rows), blocks] first token of each prompt block (-1 past the prompt,
        never a marker) and, with `span_ids`, its span id (span_identity.NO_ID outside
        spans; else None), and [len(rows)] prompt lengths."""
        firsts = np.full((len(rows), blocks), -1, dtype=np.int64)
        ids = np.full((len(rows), blocks), NO_ID, dtype=np.int64) if span_ids else None
        lengths = np.empty(len(rows), dtype=np.int64)
        for i, row in enumerate(rows.tolist()):
            key = (row, block_size)
            prompt_firsts = self._firsts.get(key)
            if prompt_firsts is None:
                prompt_firsts = self._firsts[key] = np.asarray(
                    self._prompts[row][::block_size], dtype=np.int64)
            shown = min(blocks, prompt_firsts.size)
            firsts[i, :shown] = prompt_firsts[:shown]
            if span_ids:
                ids[i, :shown] = self._span_ids(key)[:shown]
            lengths[i] = len(self._prompts[row])
        return firsts, ids, lengths

    def _array(self, row: int) -> np.ndarray:
        """Row `row`'s prompt as int64 ids, converted once while the row runs it."""
        found = self._arrays.get(row)
        if found is None:
            found = self._arrays[row] = np.asarray(self._prompts[row], dtype=np.int64)
        return found

    def _span_ids(self, key: tuple[int, int]) -> np.ndarray:
        """The prompt's span ids, hashed once (about a microsecond a block)."""
        found = self._ids.get(key)
        if found is None:
            prompt = self._array(key[0])
            if self._shareable[key[0]]:
                found = self.span_ids.take(prompt, key[1], self._protocol.ssep_token_id,
                                           self._protocol.markers)
            else:
                found = (np.full(-(-prompt.size // key[1]), NO_ID, dtype=np.int64), [])
            self._ids[key] = found
        return found[0]
