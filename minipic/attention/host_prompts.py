"""Worker side: each running request's prompt on the host, for Model Runner V2.

MRV2 keeps token ids where the GPU reads them; reading them back to build a batch's
span layout waits for the GPU at every step (and with vLLM's asynchronous scheduling
stops the host from preparing a step while the previous one runs). Markers count in
prompts only (the hasher's rule), so the layout needs nothing but the prompts, kept
here from when the runner adds a request (a resumed request, or one whose streamed
input grew, is added again) until it removes it (finished or preempted).
"""

from __future__ import annotations

import array
from typing import Callable, Iterable

import numpy as np

from minipic.attention.span_identity import NO_ID, SpanIds
from minipic.protocol import SpanProtocol


# Table growth steps: rows past the highest row seen, blocks past the longest prompt seen.
ROW_STEP, BLOCK_STEP = 256, 64


class _BlockTable:
    """One block size's first token and span id of every prompt block, [rows, blocks]: a
    batch's are one gather (a step runs a thousand rows, each new one filled once). It holds
    12 bytes per row and block of the longest prompt seen (up to half again), and never
    shrinks: 1024 rows after a 131072-token prompt at block size 16, 96 to 144 MiB."""

    def __init__(self) -> None:
        self.firsts = np.full((0, 0), -1, dtype=np.int32)  # token ids fit in 31 bits
        self.ids = np.full((0, 0), NO_ID, dtype=np.int64)
        self.filled = np.zeros(0, dtype=np.int64)  # blocks each row's prompt has
        self.has_firsts: set[int] = set()  # rows filled for the prompt they run now
        self.has_ids: set[int] = set()
        self.spans: dict[int, list[tuple[int, bytes]]] = {}  # row -> its ids' spans

    def fit(self, row: int, blocks: int) -> None:
        """Room for `row` and `blocks` blocks."""
        rows, width = self.firsts.shape
        if row < rows and blocks <= width:
            return
        # widths grow by half at least, so prompts that lengthen a few blocks at a time
        # copy the table a few times, not once each
        shape = (max(rows, _rows_for(row)), width if blocks <= width
                 else max(-(-blocks // BLOCK_STEP) * BLOCK_STEP, width * 3 // 2))
        self.firsts = _grown(self.firsts, shape, -1)
        self.ids = _grown(self.ids, shape, NO_ID)
        self.filled = _grown(self.filled, shape[:1], 0)


def _rows_for(row: int) -> int:
    """How many rows a table holding `row` has (rows are bounded by max_num_seqs)."""
    return -(-(row + 1) // ROW_STEP) * ROW_STEP


def _grown(table: np.ndarray, shape: tuple[int, ...], empty: int) -> np.ndarray:
    """`table` in the larger `shape`, `empty` in the new entries."""
    grown = np.full(shape, empty, dtype=table.dtype)
    grown[tuple(slice(0, n) for n in table.shape)] = table
    return grown


def _gather(table: np.ndarray, rows: np.ndarray, blocks: int, empty: int) -> np.ndarray:
    """table[rows, :blocks], `empty` past the table's width (a copy: layouts keep it)."""
    shown = min(blocks, table.shape[1])
    found = table[rows, :shown]
    if shown == blocks:
        return found
    return np.concatenate([found, np.full((rows.size, blocks - shown), empty,
                                          dtype=table.dtype)], axis=1)


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
        self._lengths = np.zeros(0, dtype=np.int64)  # by row
        self._tables: dict[int, _BlockTable] = {}  # by block size
        self._derived: dict[int, dict[object, object]] = {}  # row -> key -> derived()
        self.span_ids = SpanIds()
        self.generation = 0  # how many prompts were added: a layout cache's key

    def add(self, row: int, prompt: Iterable[int], shareable: bool = True) -> None:
        """Request row `row` now runs `prompt` (replacing whatever ran there before).

        `shareable` False: its KV depends on more than its tokens (a LoRA adapter,
        multimodal inputs, prompt embeddings), so its spans get no ids: never shared."""
        self._forget(row)
        self._prompts[row] = list(prompt)
        self._shareable[row] = shareable
        if row >= self._lengths.size:
            self._lengths = _grown(self._lengths, (_rows_for(row),), 0)
        self._lengths[row] = len(self._prompts[row])
        self.generation += 1  # layouts built from the rows before are stale

    def _forget(self, row: int) -> None:
        """Drop what was derived from row `row`'s prompt, its span ids given back."""
        self._arrays.pop(row, None)
        self._derived.pop(row, None)
        for table in self._tables.values():
            table.has_firsts.discard(row)
            table.has_ids.discard(row)
            self.span_ids.release(table.spans.pop(row, []))

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
        derived = self._derived.setdefault(row, {})
        found = derived.get(key)
        if found is None:
            found = derived[key] = compute(self._array(row))
        return found

    def blocks(self, rows: np.ndarray, block_size: int, blocks: int,
               span_ids: bool | np.ndarray = True
               ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """[len(rows), blocks] first token of each prompt block (-1 past the prompt,
        never a marker); the span id of each block (span_identity.NO_ID outside spans) of
        the rows `span_ids` names (True: all, else a [len(rows)] bool mask; the others'
        are NO_ID), None when it names none; and [len(rows)] prompt lengths."""
        table = self._tables.setdefault(block_size, _BlockTable())
        for row in rows.tolist():
            if row not in table.has_firsts:
                self._fill_firsts(table, row, block_size)
        wanted = np.broadcast_to(np.asarray(span_ids, dtype=bool), rows.shape)
        ids = None
        if wanted.any():
            for row in rows[wanted].tolist():
                if row not in table.has_ids:
                    self._fill_ids(table, row, block_size)
            ids = _gather(table.ids, rows, blocks, NO_ID)
            ids[~wanted] = NO_ID
        return _gather(table.firsts, rows, blocks, -1), ids, self._lengths[rows]

    def _fill_firsts(self, table: _BlockTable, row: int, block_size: int) -> None:
        """Row `row`'s block first tokens; past them, as far as the row's last prompt
        reached, nothing (-1; a row's ids are cleared in the same stretch)."""
        firsts = self._prompts[row][::block_size]
        table.fit(row, len(firsts))
        reached = max(len(firsts), int(table.filled[row]))
        table.firsts[row, : len(firsts)] = firsts
        table.firsts[row, len(firsts): reached] = -1
        table.ids[row, :reached] = NO_ID  # filled again by _fill_ids if asked for
        table.filled[row] = len(firsts)
        table.has_firsts.add(row)

    def _fill_ids(self, table: _BlockTable, row: int, block_size: int) -> None:
        """The prompt's span ids, hashed once while the row runs it (after its firsts,
        which clear the row's old ids)."""
        if self._shareable[row]:
            ids, table.spans[row] = self.span_ids.take(
                self._array(row), block_size, self._protocol.ssep_token_id,
                self._protocol.markers)
            table.ids[row, : ids.size] = ids
        table.has_ids.add(row)

    def _array(self, row: int) -> np.ndarray:
        """Row `row`'s prompt as int64 ids, converted once while the row runs it."""
        found = self._arrays.get(row)
        if found is None:  # through array: a third faster than from the list
            found = self._arrays[row] = np.frombuffer(array.array("q", self._prompts[row]),
                                                      dtype=np.int64)
        return found
