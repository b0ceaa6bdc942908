"""Worker side (Model Runner V2): which decode steps replay a full CUDA graph.

vLLM picks a step's graph (CudaGraphManager.dispatch) before minipic's metadata builder
sees the batch. minipic's dispatch patch (_vllm_patches) asks `takes_full_graph` first
and notes the answer for the builder (`note_graph_step`, read by `graph_step`): a
decode batch replays the rows graph (decode_graph.py) when some request has spans and
the batch's earlier row tokens fit the graph; otherwise it runs the piecewise graphs,
where a batch without spans gets stock's FlashAttention (on plain prompts the rows graph
measured 1.39x stock's full graph, docs/benchmarks.md).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from minipic.attention.decode_graph import earlier_capacity
from minipic.attention.segment_plan import segment_plan
from minipic.attention.span_layout import current_protocol, span_layout

# None unless the step being run replays a full decode graph, else how many of its
# requests are real (0: a dummy run, every request padding).
_graph_step: int | None = None
_block_size: int | None = None  # the span layout's, noted by the metadata builder


def note_block_size(block_size: int) -> None:
    """The engine's one attention builder (minipic refuses hybrid models: one KV cache
    group) notes its block size; a later engine in the process notes its own."""
    global _block_size
    _block_size = block_size


def note_graph_step(real_reqs: int | None) -> None:
    global _graph_step
    _graph_step = real_reqs


def graph_step() -> int | None:
    return _graph_step


class DecodeNeed(NamedTuple):
    """What a full decode graph must hold for one request (its prompt alone)."""

    earlier_tokens: int  # its decode query's earlier row tokens
    plain: bool  # its layout is plain (SpanLayout.is_plain): stock attention


def takes_full_graph(runner, req_ids, num_reqs: int) -> bool:
    """Whether the decode batch of `req_ids` replays the full graph of num_reqs requests:
    some request has spans, and the sum of their earlier row tokens fits the graph."""
    prompts = getattr(runner, "minipic_host_prompts", None)
    block_size = _block_size
    if prompts is None or block_size is None:
        return False
    index = runner.req_states.req_id_to_index
    rows = [index.get(req_id) for req_id in req_ids]
    if None in rows or not prompts.holds(np.asarray(rows)):
        return False
    from vllm.utils.torch_utils import set_default_torch_num_threads

    with set_default_torch_num_threads(1):  # small host ops (see SpanBatchBuilder.build)
        needs = [prompts.derived(row, ("decode_need", block_size),
                                 lambda prompt: decode_need(prompt, block_size))
                 for row in rows]
    return (not all(need.plain for need in needs)
            and sum(need.earlier_tokens for need in needs) <= earlier_capacity(num_reqs))


def decode_need(prompt: np.ndarray, block_size: int) -> DecodeNeed:
    """One prompt's DecodeNeed, from its block first tokens: its decode query's plan at its
    first generated token and one block on (where a generated block would start a
    segment), sharing aside (it merges rows, not tokens). Later positions need no more
    while generated tokens extend the last segment (see segment_plan)."""
    blocks = -(-(prompt.size + 1) // block_size) + 1
    firsts = np.full(blocks, -1, dtype=np.int64)
    shown = prompt[::block_size]
    firsts[: shown.size] = shown
    layout = span_layout(torch.from_numpy(firsts[None]), current_protocol(), block_size,
                         torch.tensor([prompt.size]))
    tokens = 0
    for position in (prompt.size, prompt.size + block_size):
        plan = segment_plan(layout, [0, 1], [position + 1], block_size, link_shifts=True)
        tokens = max(tokens, 0 if plan.earlier is None else plan.earlier.query_index.numel())
    return DecodeNeed(tokens, layout.is_plain())
