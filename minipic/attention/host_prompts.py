"""Worker side: each running request's prompt on the host, for Model Runner V2.

MRV2 keeps token ids where the GPU reads them; reading them back to build a batch's
span layout waits for the GPU at every step (and with vLLM's asynchronous scheduling
stops the host from preparing a step while the previous one runs). Markers count in
prompts only (the hasher's rule), and a prompt never changes while its request runs,
so the layout needs nothing but the prompts, kept here when the runner adds requests
(a resumed request is added again, with the same prompt).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from minipic.attention.span_identity import SpanIds
from minipic.protocol import SpanProtocol


class HostPrompts:
    """Prompt token ids by the runner's request row (req_states' index), with each
    prompt's block first tokens and span block ids (span_identity.py) per block size."""

    def __init__(self, protocol: SpanProtocol) -> None:
        self._protocol = protocol
        self._prompts: dict[int, np.ndarray] = {}
        # (row, block_size) -> (first token of each block, span ids, chains held)
        self._blocks: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, list[bytes]]] = {}
        self.span_ids = SpanIds()

    def add(self, row: int, prompt: Iterable[int]) -> None:
        """Request row `row` now runs `prompt` (replacing whatever ran there before)."""
        self._prompts[row] = np.asarray(prompt, dtype=np.int64)
        for key in [k for k in self._blocks if k[0] == row]:
            self.span_ids.release(self._blocks.pop(key)[2])

    def blocks(self, rows: np.ndarray, block_size: int, blocks: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """[len(rows), blocks] first token of each prompt block (-1 past the prompt,
        never a marker) and its span id (span_identity.NO_ID outside spans), and
        [len(rows)] prompt lengths."""
        firsts = np.full((len(rows), blocks), -1, dtype=np.int64)
        ids = np.full((len(rows), blocks), -1, dtype=np.int64)
        lengths = np.empty(len(rows), dtype=np.int64)
        for i, row in enumerate(rows.tolist()):
            prompt_firsts, prompt_ids, _ = self._prompt_blocks(row, block_size)
            shown = min(blocks, prompt_firsts.size)
            firsts[i, :shown] = prompt_firsts[:shown]
            ids[i, :shown] = prompt_ids[:shown]
            lengths[i] = self._prompts[row].size
        return firsts, ids, lengths

    def _prompt_blocks(self, row: int, block_size: int):
        found = self._blocks.get((row, block_size))
        if found is None:
            prompt = self._prompts[row]
            ids, chains = self.span_ids.take(prompt, block_size, self._protocol.ssep_token_id,
                                             self._protocol.markers)
            found = self._blocks[(row, block_size)] = (prompt[::block_size], ids, chains)
        return found
