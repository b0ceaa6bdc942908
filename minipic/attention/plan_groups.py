"""Worker side: a span batch whose earlier rows would copy too many queries, planned as
groups of query tokens attended one after another.

Each earlier row copies its run's queries (turned into the row's frame), and the copies,
their outputs and log-sum-exps live through a layer's attention: about 16 KiB a copy on
Llama-3-8B. A step of 500 short final prompts over ten cached documents each copies 165k
queries (2.7 GB); so does one 4k-token task chunk over 40 documents. No query reads
another's, so the batch splits exactly between any two query tokens: each group's plan
copies at most `limit` queries, and the groups' calls reuse the same memory one after
another. A group holds whole requests where it can; a request cut between groups leaves
each group a piece of its queries, planned as a request whose sequence ends at the
piece's last query (causal attention never reads past it). One plan is faster where
memory allows (fewer launches and host plans; shared documents read once): `copy_limit`
lets the copies take what vLLM's memory profile already set aside for a batch's MLP
activations.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from minipic.attention.segment_plan import SegmentPlan, segment_plan
from minipic.attention.span_layout import SpanLayout

# The limit whatever the model: 32768 copies are about 0.5 GB on Llama-3-8B.
MIN_COPY_LIMIT = 32768


@dataclasses.dataclass
class PlanGroup:
    """The batch's query tokens [first_token, end_token): pieces of its requests
    [first_request, end_request) (the first and last may be cut), and their own plan,
    whose request and token indices start at 0."""

    first_token: int
    end_token: int
    first_request: int
    end_request: int
    plan: SegmentPlan


def copy_limit(max_batched_tokens: int, intermediate_size: int | list | None,
               tensor_parallel_size: int, heads: int, head_size: int, itemsize: int) -> int:
    """How many query copies a batch's rows may hold at once (`heads`: this rank's): as
    many as fit in the memory of a full batch's up projection output on this rank
    (2 x intermediate_size values a token, gated MLP or not). With what else lives through
    attention (the QKV projection, the own rows' turned queries and output: about 36 KiB a
    token on Llama-3-8B beside the copies' 56) that is about what a gated MLP's activations
    took in vLLM's profile run (84 KiB a token), which vLLM keeps free of KV cache; any
    rest comes from its memory headroom. At least MIN_COPY_LIMIT (also where the model
    names no MLP size): 57k on Llama-3-8B at 16384 batched tokens, one GPU."""
    per_copy = heads * (2 * head_size * itemsize + 4)  # turned query, output, fp32 LSE
    if not isinstance(intermediate_size, int):  # none, or one per layer (Gemma-3n)
        intermediate_size = 0
    mlp = 2 * intermediate_size // tensor_parallel_size * itemsize
    return max(MIN_COPY_LIMIT, max_batched_tokens * mlp // per_copy)


def earlier_copies(plan: SegmentPlan) -> int:
    """How many query copies the plan's earlier rows hold."""
    return 0 if plan.earlier is None else plan.earlier.query_index.numel()


def token_groups(plan: SegmentPlan, query_start_loc: list[int], limit: int
                 ) -> list[tuple[int, int]]:
    """Consecutive query token ranges [first, end) of the batch whose earlier rows copy at
    most `limit` queries each, cut greedily: each group ends at the last request end
    within its reach (whole requests plan as they would alone, at the cost of a few more
    groups), or inside a request that alone reaches past it. (A
    single token copies once per document it reads: more than `limit` only if it reads
    that many; such a token forms a group of its own.)"""
    starts = np.asarray(query_start_loc, dtype=np.int64)
    tokens = int(starts[-1])
    if plan.earlier is None:
        return [(0, tokens)]
    copies_before = np.concatenate(
        [[0], np.cumsum(np.bincount(plan.earlier.query_index.numpy(), minlength=tokens))])
    groups, first = [], 0
    while first < tokens:
        # the furthest token end whose copies since `first` stay within the limit
        reach = int(np.searchsorted(copies_before, copies_before[first] + limit,
                                    side="right")) - 1
        reach = max(reach, first + 1)
        request_end = int(starts[np.searchsorted(starts, reach, side="right") - 1])
        end = request_end if request_end > first else reach
        groups.append((first, end))
        first = end
    return groups


def group_plans(layout: SpanLayout, query_start_loc: list[int], seq_lens: list[int],
                block_size: int, groups: list[tuple[int, int]], link_shifts: bool = False
                ) -> list[PlanGroup]:
    """Each token group's plan, over its requests' rows of `layout` (on the host;
    `link_shifts` as segment_plan takes it)."""
    starts = np.asarray(query_start_loc, dtype=np.int64)
    seq = np.asarray(seq_lens, dtype=np.int64)
    planned = []
    for first, end in groups:
        first_request = int(np.searchsorted(starts, first, side="right")) - 1
        end_request = int(np.searchsorted(starts, end, side="left"))
        requests = np.arange(first_request, end_request)
        piece_starts = np.clip(starts[requests], first, None) - first
        piece_ends = np.clip(starts[requests + 1], None, end)
        # a piece's sequence ends at its last query: the request's end, less what was cut
        piece_seq = seq[requests] - (starts[requests + 1] - piece_ends)
        tokens = [*piece_starts.tolist(), end - first]
        plan = segment_plan(_requests(layout, first_request, end_request), tokens,
                            piece_seq.tolist(), block_size, link_shifts)
        planned.append(PlanGroup(first, end, first_request, end_request, plan))
    return planned


def _requests(layout: SpanLayout, first: int, end: int) -> SpanLayout:
    """`layout`'s rows of requests [first, end) (a new layout: nothing derived is shared)."""
    return dataclasses.replace(layout, **{
        field.name: getattr(layout, field.name)[first:end]
        for field in dataclasses.fields(layout)
        if field.init and getattr(layout, field.name) is not None})
