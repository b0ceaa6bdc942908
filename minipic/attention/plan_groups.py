"""Worker side: a span batch whose earlier rows would copy too many queries, planned as
groups of requests attended one after another.

Each earlier row copies its run's queries (turned into the row's frame), and the copies,
their outputs and log-sum-exps live through a layer's attention: about 16 KiB a copy on
Llama-3-8B. A step of 500 short final prompts over ten cached documents each copies 165k
queries (2.7 GB). No request reads another's queries, so the batch splits exactly at
request boundaries: each group's plan copies at most `limit` queries, and the groups'
calls reuse the same memory one after another. One plan is faster where memory allows
(fewer launches and host plans; shared documents read once): `copy_limit` lets the copies
take what vLLM's memory profile already set aside for a batch's MLP activations.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from minipic.attention.segment_plan import SegmentPlan, segment_plan
from minipic.attention.span_layout import SpanLayout


@dataclasses.dataclass
class PlanGroup:
    """Requests [first_request, end_request) of a batch, its query tokens
    [first_token, end_token), and their own plan (token and request indices from 0)."""

    first_request: int
    end_request: int
    first_token: int
    end_token: int
    plan: SegmentPlan


# The limit whatever the model: 32768 copies are about 0.5 GB on Llama-3-8B.
MIN_COPY_LIMIT = 32768


def copy_limit(max_batched_tokens: int, intermediate_size: int | None, heads: int,
               head_size: int, itemsize: int) -> int:
    """How many query copies a batch's rows may hold at once: as many as fit in the memory
    of a full batch's MLP activations (its gate and up projections' output and their
    product, 3 x intermediate_size values a token), which vLLM's profile run measured and
    keeps free of KV cache; at least MIN_COPY_LIMIT (also where the model names no MLP
    size). 85k on Llama-3-8B at 16384 batched tokens."""
    per_copy = heads * (2 * head_size * itemsize + 4)  # turned query, output, fp32 LSE
    mlp = 3 * (intermediate_size or 0) * itemsize
    return max(MIN_COPY_LIMIT, max_batched_tokens * mlp // per_copy)


def earlier_copies(plan: SegmentPlan) -> int:
    """How many query copies the plan's earlier rows hold."""
    return 0 if plan.earlier is None else plan.earlier.query_index.numel()


def request_groups(plan: SegmentPlan, query_start_loc: list[int], limit: int
                   ) -> list[tuple[int, int]] | None:
    """Consecutive request ranges [first, end) whose earlier rows copy at most `limit`
    queries each, as few as a greedy cut gives; None when one request alone copies more."""
    starts = np.asarray(query_start_loc, dtype=np.int64)
    copies_by_token = np.bincount(plan.earlier.query_index.numpy(), minlength=int(starts[-1]))
    copies_before = np.concatenate([[0], np.cumsum(copies_by_token)])[starts]
    if np.diff(copies_before).max(initial=0) > limit:
        return None
    groups, first = [], 0
    while first < starts.size - 1:
        # the furthest request end whose copies since `first` stay within the limit
        end = int(np.searchsorted(copies_before, copies_before[first] + limit, side="right")) - 1
        groups.append((first, end))
        first = end
    return groups


def group_plans(layout: SpanLayout, query_start_loc: list[int], seq_lens: list[int],
                block_size: int, groups: list[tuple[int, int]], link_shifts: bool = False
                ) -> list[PlanGroup]:
    """Each group's plan, over its requests' rows of `layout` (on the host; `link_shifts`
    as segment_plan takes it)."""
    planned = []
    for first, end in groups:
        tokens = [start - query_start_loc[first] for start in query_start_loc[first: end + 1]]
        plan = segment_plan(_requests(layout, first, end), tokens, seq_lens[first:end],
                            block_size, link_shifts)
        planned.append(PlanGroup(first, end, query_start_loc[first], query_start_loc[end], plan))
    return planned


def _requests(layout: SpanLayout, first: int, end: int) -> SpanLayout:
    """`layout`'s rows of requests [first, end) (a new layout: nothing derived is shared)."""
    return dataclasses.replace(layout, **{
        field.name: getattr(layout, field.name)[first:end]
        for field in dataclasses.fields(layout)
        if field.init and getattr(layout, field.name) is not None})
