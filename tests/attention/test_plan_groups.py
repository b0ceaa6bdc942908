"""A span batch planned as groups of requests (plan_groups.py) against the independent
reference, on CPU: the rows run through `paged_flash_reference`, as in
test_segment_plan.py. The GPU tests run grouped batches on FA3."""

from __future__ import annotations

import functools

import pytest
import torch

from minipic.attention.plan_groups import (MIN_COPY_LIMIT, copy_limit, earlier_copies,
                                           group_plans, request_groups)
from minipic.attention.rotation import Rotation
from minipic.attention.segment_attention import (NewKeys, grouped_attention,
                                                 paged_flash_reference, prepare_groups,
                                                 with_block_table)
from minipic.attention.segment_plan import segment_plan
from minipic.attention.span_layout import key_turn_backs
from minipic.devtools.paged_attention_case import (epic_markers, make_case, reference_attention,
                                                   relative_error, shared_documents_case)


def tasks_over_spans_case(seed: int = 0):
    """Four requests: short tasks after cached spans (hits), a decode step over spans and a
    plain prompt (no earlier rows), as a step of many final prompts holds them."""
    return make_case([33, 1, 20, 40], [16 * 21, 300, 16 * 13, 0], num_q_heads=4,
                     num_kv_heads=2, head_size=32, dtype=torch.float32, seed=seed,
                     markers=["-" + "S---" * 5 + "P--", "-S---P" + "-" * 14,
                              epic_markers(3, 3, 1, 2) + "-", ""])


def copies_by_request(plan, query_start_loc: list[int]) -> list[int]:
    token = plan.earlier.query_index
    return [int(((token >= a) & (token < b)).sum())
            for a, b in zip(query_start_loc, query_start_loc[1:])]


def test_groups_cut_at_requests_within_the_limit():
    case = tasks_over_spans_case()
    qsl = case.cu_seqlens_q.tolist()
    plan = segment_plan(case.layout, qsl, case.seq_lens.tolist(), 16)
    copies = copies_by_request(plan, qsl)
    assert sum(copies) == earlier_copies(plan) and min(copies[:3]) > 0 and copies[3] == 0
    for limit in range(max(copies), sum(copies) + 1):
        groups = request_groups(plan, qsl, limit)
        assert groups[0][0] == 0 and groups[-1][1] == len(copies)
        assert all(a[1] == b[0] for a, b in zip(groups, groups[1:]))  # consecutive
        assert all(sum(copies[first:end]) <= limit for first, end in groups)
        # greedy: no group could take its next request too
        assert all(sum(copies[first:end + 1]) > limit for first, end in groups[:-1])
    assert len(request_groups(plan, qsl, sum(copies))) == 1
    assert request_groups(plan, qsl, max(copies) - 1) is None  # one request alone is over


@pytest.mark.parametrize("seed", [0, 1])
def test_grouped_batch_matches_the_reference(seed):
    """Groups of one and three requests give the reference's answer; the first group's call
    writes every new key of the batch (turned into its frame), before any group reads."""
    case = tasks_over_spans_case(seed)
    qsl, seq_lens = case.cu_seqlens_q.tolist(), case.seq_lens.tolist()
    plan = segment_plan(case.layout, qsl, seq_lens, 16)
    groups = request_groups(plan, qsl, max(copies_by_request(plan, qsl)))
    assert len(groups) == 2 and groups[1][1] - groups[1][0] == 3
    planned = group_plans(case.layout, qsl, seq_lens, 16, groups)
    assert [g.first_token for g in planned] == [qsl[first] for first, _ in groups]

    turn = key_turn_backs(case.layout, qsl, seq_lens, 16)
    slots = case.query_slots()
    stored = case.k_cache[slots]
    model_k = Rotation.at(turn, case.cos_sin, case.rotary_dim, case.is_neox,
                          pure=True).apply(stored).to(stored.dtype)
    case.k_cache[slots] = float("nan")  # read before the write: NaN out
    written = []

    def write(turned):
        written.append(turned.shape[0])
        case.k_cache[slots] = turned

    batch = prepare_groups(planned, case.block_table, case.cos_sin, case.rotary_dim,
                           case.is_neox)
    out = torch.full_like(case.q, float("nan"))
    grouped_attention(case.q, case.k_cache, case.v_cache, out, batch,
                      functools.partial(paged_flash_reference, scale=case.scale),
                      NewKeys(model_k, Rotation.back(turn, case.cos_sin, case.rotary_dim,
                                                     case.is_neox), write))
    assert written == [case.q.shape[0]]
    assert relative_error(out, reference_attention(case)) < 1e-5


def test_shared_documents_in_groups_match_the_reference():
    """Requests sharing documents read them in one row inside a group; across groups each
    group reads them itself. Either way, the reference's answer."""
    case = shared_documents_case(dtype=torch.float32, query_lens=(20, 1, 20))
    qsl, seq_lens = case.cu_seqlens_q.tolist(), case.seq_lens.tolist()
    plan = segment_plan(case.layout, qsl, seq_lens, 16)
    for limit in (max(copies_by_request(plan, qsl)), earlier_copies(plan) - 1):
        groups = request_groups(plan, qsl, limit)
        assert len(groups) > 1
        batch = prepare_groups(group_plans(case.layout, qsl, seq_lens, 16, groups),
                               case.block_table, case.cos_sin, case.rotary_dim, case.is_neox)
        out = torch.full_like(case.q, float("nan"))
        grouped_attention(case.q, case.k_cache, case.v_cache, out, batch,
                          functools.partial(paged_flash_reference, scale=case.scale))
        assert relative_error(out, reference_attention(case)) < 1e-5


def test_another_block_table_moves_each_groups_rows():
    """vLLM's update_block_table: each group's row tables follow the new table's rows of
    its own requests."""
    case = tasks_over_spans_case()
    qsl, seq_lens = case.cu_seqlens_q.tolist(), case.seq_lens.tolist()
    plan = segment_plan(case.layout, qsl, seq_lens, 16)
    groups = request_groups(plan, qsl, max(copies_by_request(plan, qsl)))
    batch = prepare_groups(group_plans(case.layout, qsl, seq_lens, 16, groups),
                           case.block_table, case.cos_sin, case.rotary_dim, case.is_neox)
    other = case.block_table + 1000
    moved = with_block_table(batch, other)
    for group, part in zip(moved.groups, moved.batches):
        rows = part.plan.joint if part.plan.joint is not None else part.plan.own
        table = part.joint_table if part.plan.joint is not None else part.own_table
        expected = other[group.first_request: group.end_request][
            rows.row_request[:, None], rows.row_blocks]
        assert torch.equal(table, expected)


def test_copies_may_take_the_memory_of_a_batchs_mlp_activations():
    """Llama-3-8B (32 heads of 128, MLP 14336, bf16) at 16384 batched tokens: the copies
    (16.1 KiB each) may take what the batch's MLP activations took in vLLM's profile run
    (84 KiB a token); never fewer than MIN_COPY_LIMIT, also without an MLP size."""
    limit = copy_limit(16384, 14336, 32, 128, 2)
    assert limit == 16384 * 3 * 14336 * 2 // (32 * (2 * 128 * 2 + 4)) == 85349
    assert limit * 32 * (2 * 128 * 2 + 4) <= 16384 * 3 * 14336 * 2
    assert copy_limit(256, 14336, 32, 128, 2) == MIN_COPY_LIMIT
    assert copy_limit(16384, None, 32, 128, 2) == MIN_COPY_LIMIT
