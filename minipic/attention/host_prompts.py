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


class HostPrompts:
    """Prompt token ids by the runner's request row (req_states' index)."""

    def __init__(self) -> None:
        self._prompts: dict[int, np.ndarray] = {}
        self._firsts: dict[tuple[int, int], np.ndarray] = {}  # (row, block_size) -> ids

    def add(self, row: int, prompt: Iterable[int]) -> None:
        """Request row `row` now runs `prompt` (replacing whatever ran there before)."""
        self._prompts[row] = np.asarray(prompt, dtype=np.int64)
        for key in [k for k in self._firsts if k[0] == row]:
            del self._firsts[key]

    def block_firsts(self, rows: np.ndarray, block_size: int, blocks: int
                     ) -> tuple[np.ndarray, np.ndarray]:
        """[len(rows), blocks] first token of each prompt block (-1 past the prompt,
        never a marker), and [len(rows)] prompt lengths."""
        firsts = np.full((len(rows), blocks), -1, dtype=np.int64)
        lengths = np.empty(len(rows), dtype=np.int64)
        for i, row in enumerate(rows.tolist()):
            prompt_firsts = self._firsts.get((row, block_size))
            if prompt_firsts is None:
                prompt_firsts = self._prompts[row][::block_size]
                self._firsts[(row, block_size)] = prompt_firsts
            shown = prompt_firsts[:blocks]
            firsts[i, : shown.size] = shown
            lengths[i] = self._prompts[row].size
        return firsts, lengths
