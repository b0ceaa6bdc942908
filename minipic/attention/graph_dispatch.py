"""Worker side (Model Runner V2): which steps replay a full CUDA graph.

vLLM picks a step's graph (CudaGraphManager.dispatch) before minipic's metadata builder
sees the batch. minipic's dispatch patch (_vllm_patches) asks here first and notes the
answer for the builder (`note_graph_step`, read by `graph_step`):
  * a uniform decode batch replays vLLM's full decode graph on the rows (graph_rows.py)
    when some request has spans and the batch's earlier row tokens fit the graph
    (`takes_full_graph`);
  * one request's short prefill over spans (a span hit's question) replays one of
    minipic's prefill graphs, captured beside vLLM's at its capture sizes up to
    PREFILL_GRAPH_TOKENS_MAX (`prefill_graph_sizes`), when its own rows go one query each
    and its earlier row tokens fit (`takes_prefill_graph`). vLLM's default mode runs such
    a step piecewise, its attention eager between the pieces: the step is host-bound
    (docs/benchmarks.md, "Span hit TTFT").
Otherwise the step runs the piecewise graphs, where a batch without spans gets stock's
FlashAttention (on plain prompts the rows graph measured 1.39x stock's full graph,
docs/benchmarks.md).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from minipic.attention.graph_rows import earlier_capacity
from minipic.attention.segment_plan import SegmentPlan, segment_plan
from minipic.attention.span_layout import SpanLayout, current_protocol, host_layout, span_layout

# A question of up to this many tokens replays a prefill graph (the question of a hit in
# tools/bench_ttft.py is 33 tokens; 128 asks 128 * 64 earlier row tokens at most).
PREFILL_GRAPH_TOKENS_MAX = 128

# None unless the step being run replays a full graph, else how many of its requests are
# real (0: a dummy run, every request padding).
_graph_step: int | None = None
_block_size: int | None = None  # the span layout's, noted by the metadata builder
# The plan takes_prefill_graph made for the step: (layout, query_start_loc, seq_lens, plan)
_prefill_plan: tuple[SpanLayout, list[int], list[int], SegmentPlan] | None = None


def note_block_size(block_size: int) -> None:
    """The engine's one attention builder (minipic refuses hybrid models: one KV cache
    group) notes its block size; a later engine in the process notes its own."""
    global _block_size
    _block_size = block_size


def note_graph_step(real_reqs: int | None) -> None:
    global _graph_step, _prefill_plan
    _graph_step = real_reqs
    if real_reqs is None:
        _prefill_plan = None


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


def prefill_graph_sizes(capture_sizes: list[int] | None) -> list[int]:
    """vLLM's capture sizes at which minipic captures a prefill graph too."""
    return sorted(s for s in capture_sizes or () if 1 < s <= PREFILL_GRAPH_TOKENS_MAX)


def takes_prefill_graph(runner, scheduled: dict[str, int], graph_tokens: int) -> bool:
    """Whether the batch `scheduled` ({request: tokens}) replays the prefill graph of
    graph_tokens tokens: one request, a prompt with spans, its own rows one query each
    and its earlier row tokens within the graph's. Its plan is noted for the builder,
    which finds the layout made too (span_layout.host_layout)."""
    global _prefill_plan
    prompts = getattr(runner, "minipic_host_prompts", None)
    block_size = _block_size
    if prompts is None or block_size is None or len(scheduled) != 1:
        return False
    (req_id, tokens), = scheduled.items()
    row = runner.req_states.req_id_to_index.get(req_id)
    if row is None or not 1 < tokens <= graph_tokens:
        return False
    rows = np.array([row], dtype=np.int32)  # as the runner's idx_mapping
    if not prompts.holds(rows) or not prompts.derived(
            row, ("marked", block_size), lambda prompt: _marked(prompt, block_size)):
        return False  # a plain prompt (most chat requests): no layout to make
    seq_len = int(runner.req_states.num_computed_tokens_np[row]) + tokens
    from vllm.utils.torch_utils import set_default_torch_num_threads

    with set_default_torch_num_threads(1):  # small host ops (see SpanBatchBuilder.build)
        layout = host_layout(prompts, rows, block_size, -(-seq_len // block_size) * block_size)
        if layout is None or layout.is_plain():
            return False  # stock's attention, piecewise
        query_start_loc, seq_lens = [0, tokens], [seq_len]
        plan = segment_plan(layout, query_start_loc, seq_lens, block_size, link_shifts=True)
    if plan.joint is None or plan.earlier.query_index.numel() > earlier_capacity(
            graph_tokens, prefill=True):
        return False
    _prefill_plan = (layout, query_start_loc, seq_lens, plan)
    return True


def _marked(prompt: np.ndarray, block_size: int) -> bool:
    """Whether a block of the prompt starts with a marker (else its layout is plain)."""
    return not current_protocol().markers.isdisjoint(prompt[::block_size].tolist())


def prefill_plan(layout: SpanLayout, query_start_loc: list[int], seq_lens: list[int]
                 ) -> SegmentPlan | None:
    """The plan takes_prefill_graph made for this batch, if it is this batch's."""
    noted = _prefill_plan
    if noted is None or noted[0] is not layout or noted[1:3] != (query_start_loc, seq_lens):
        return None
    return noted[3]


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
