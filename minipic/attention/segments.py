"""Worker side: span segments, i.e. the first key each query may attend to.

An SSep block's hash says "my KV depends only on the tokens from my span's
SSep block on". Attention makes that true: a query inside an SSep span sees
keys from the span's first block only; a query after PDep, or with no marker
before it, sees everything before it (stock causal attention). So a span
computed inside a final prompt (because it missed) gets exactly the KV it
would get prefilled alone, and whatever lands in the cache under an SSep hash
is honest, whatever order requests come in.

Attention metadata carries no token ids, so the marker blocks are read from
the model runner's own per-request token table:
  * V1 runner (CPU, and CUDA with VLLM_USE_V2_MODEL_RUNNER=0):
    `input_batch.token_ids_cpu_tensor`, row i = request i of the batch;
  * Model Runner V2 (CUDA default on vLLM 0.25): `req_states.all_token_ids.gpu`,
    rows picked by the batch's `idx_mapping`.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any, Callable

import torch

from minipic.protocol import SpanProtocol


def _no_runner() -> Any:
    return None


_runner: Callable[[], Any] = _no_runner  # a weak reference to the registered runner
_protocol: SpanProtocol | None = None
_mrv2_idx_mapping: torch.Tensor | None = None  # rows of the batch being run (MRV2)


class OneEnginePerProcessError(RuntimeError):
    """A second minipic engine in a process that still runs one."""


def register_runner(runner: Any, protocol: SpanProtocol) -> None:
    """Called when minipic's worker builds its model runner (see _vllm_patches).

    The runner and the rope (attention.rope) are per process: a second live minipic
    engine in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0) would make the first one
    read the second one's tokens and rope. Refused; held weakly, so an engine that
    was shut down does not count."""
    global _runner, _protocol
    previous = _runner()
    if previous is not None and previous is not runner:
        gc.collect()  # shut down but not yet collected is not alive
        if _runner() is not None:
            raise OneEnginePerProcessError(
                "minipic serves one engine per process, and this process runs one already: "
                "shut it down first, or keep vLLM's engine processes "
                "(VLLM_ENABLE_V1_MULTIPROCESSING=1, the default)")
    _runner, _protocol = weakref.ref(runner), protocol


def note_mrv2_batch(idx_mapping: torch.Tensor) -> None:
    """Model Runner V2 prepared a batch: remember which token rows it runs."""
    global _mrv2_idx_mapping
    _mrv2_idx_mapping = idx_mapping


def segment_start_table(block_first_tokens: torch.Tensor, protocol: SpanProtocol,
                        block_size: int, prompt_lens: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """[reqs, blocks] first tokens -> [reqs, blocks] first key position each block may see.

    Markers count in the prompt only (`prompt_lens` [reqs]), as in the block hasher.
    """
    num_blocks = block_first_tokens.shape[1]
    block_index = torch.arange(num_blocks, device=block_first_tokens.device)
    is_ssep = block_first_tokens == protocol.ssep_token_id
    resets = is_ssep | (block_first_tokens == protocol.pdep_token_id)
    if prompt_lens is not None:
        in_prompt = block_index[None, :] * block_size < prompt_lens.to(block_index.device)[:, None]
        is_ssep, resets = is_ssep & in_prompt, resets & in_prompt
    # SSep starts a segment at its own block; PDep restarts "see everything" (0).
    reset_value = torch.where(is_ssep, block_index * block_size, 0)
    last_reset = torch.where(resets, block_index, -1).cummax(dim=1).values
    starts = reset_value.gather(1, last_reset.clamp(min=0))
    return torch.where(last_reset >= 0, starts, 0).to(torch.int32)


def _block_first_tokens(num_reqs: int, block_size: int
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The batch's first token of every block, and its prompt lengths."""
    runner = _runner()
    if runner is None:
        return None
    if hasattr(runner, "req_states"):  # Model Runner V2
        if _mrv2_idx_mapping is None:
            return None  # dummy / capture runs before any real batch
        rows = _mrv2_idx_mapping[:num_reqs].long()
        states = runner.req_states
        # prompt_len, not prefill_len: after a preemption prefill_len includes generated
        # tokens, which never start a span (the hasher counts prompt tokens only).
        return states.all_token_ids.gpu[:, ::block_size][rows], states.prompt_len.gpu[rows]
    batch = runner.input_batch
    return (batch.token_ids_cpu_tensor[:num_reqs, ::block_size],
            torch.from_numpy(batch.num_prompt_tokens[:num_reqs]))


def segment_table(num_reqs: int, block_size: int) -> torch.Tensor | None:
    """First visible key per (request, block) of the current batch; None if unknown."""
    found = _block_first_tokens(num_reqs, block_size)
    if found is None:
        return None
    firsts, prompt_lens = found
    return segment_start_table(firsts, _protocol, block_size, prompt_lens)


def first_visible_keys(query_start_loc: list[int], seq_lens: list[int],
                       block_size: int) -> list[torch.Tensor | None]:
    """Per request, the first visible key of each query token (None: plain causal)."""
    table = segment_table(len(seq_lens), block_size)
    if table is None or not table.any():
        return [None] * len(seq_lens)
    result: list[torch.Tensor | None] = []
    for i, seq_len in enumerate(seq_lens):
        num_queries = query_start_loc[i + 1] - query_start_loc[i]
        query_blocks = torch.arange(seq_len - num_queries, seq_len) // block_size
        result.append(table[i, query_blocks.to(table.device)])
    return result
