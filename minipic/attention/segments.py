"""Worker side: span segments, i.e. the first key each query may attend to.

An SSep block's hash says "my KV depends only on the tokens from my span's
SSep block on". Attention makes that true: a query inside an SSep span sees
keys from the span's first block only; a query after PDep, or with no marker
before it, sees everything before it (stock causal attention). So a span
computed inside a final prompt (because it missed) gets exactly the KV it
would get prefilled alone, and whatever lands in the cache under an SSep hash
is honest, whatever order requests come in.

Marker blocks are read from the model runner's token-id table (vLLM keeps
every request's tokens there, row i = request i of the batch), because
attention metadata carries no token ids.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from minipic.protocol import SpanProtocol

_runner: Any = None
_protocol: SpanProtocol | None = None


def register_runner(runner: Any, protocol: SpanProtocol) -> None:
    """Called when minipic's worker builds its model runner (see _vllm_patches)."""
    global _runner, _protocol
    _runner, _protocol = runner, protocol


def block_segment_starts(block_first_tokens: np.ndarray, block_size: int,
                         protocol: SpanProtocol) -> np.ndarray:
    """For each block, the position of the first key its tokens may see."""
    num_blocks = block_first_tokens.shape[0]
    is_ssep = block_first_tokens == protocol.ssep_token_id
    resets = is_ssep | (block_first_tokens == protocol.pdep_token_id)
    # SSep starts a segment at its own block; PDep restarts "see everything" (0).
    reset_value = np.where(is_ssep, np.arange(num_blocks) * block_size, 0)
    last_reset = np.maximum.accumulate(np.where(resets, np.arange(num_blocks), -1))
    return np.where(last_reset >= 0, reset_value[np.maximum(last_reset, 0)], 0)


def first_visible_keys(query_start_loc: list[int], seq_lens: list[int],
                       block_size: int) -> list[torch.Tensor | None]:
    """Per request, the first visible key position of each query token (None: all 0)."""
    if _runner is None:
        return [None] * len(seq_lens)
    token_ids = _runner.input_batch.token_ids_cpu
    result: list[torch.Tensor | None] = []
    for i, seq_len in enumerate(seq_lens):
        firsts = token_ids[i, 0:seq_len:block_size]
        starts = block_segment_starts(firsts, block_size, _protocol)
        if not starts.any():
            result.append(None)  # no SSep segment: plain causal attention
            continue
        num_queries = query_start_loc[i + 1] - query_start_loc[i]
        query_positions = np.arange(seq_len - num_queries, seq_len)
        result.append(torch.from_numpy(starts[query_positions // block_size]))
    return result
