"""A span batch planned as groups of query tokens (plan_groups.py) against the independent
reference, on CPU: the rows run through `paged_flash_reference`, as in
test_segment_plan.py. The GPU tests run grouped batches on FA3."""

from __future__ import annotations

import functools

import pytest
import torch

from minipic.attention.plan_groups import (MIN_COPY_LIMIT, copy_limit, earlier_copies,
                                           group_plans, token_groups)
from minipic.attention.segment_attention import (grouped_attention,
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


def copies_by_token(plan, tokens: int) -> list[int]:
    return torch.bincount(plan.earlier.query_index, minlength=tokens).tolist()


def test_groups_end_at_requests_within_the_limit():
    """Every limit from the largest request's copies up: groups of whole requests, each
    within the limit, none of which could also take the next request."""
    case = tasks_over_spans_case()
    qsl = case.cu_seqlens_q.tolist()
    plan = segment_plan(case.layout, qsl, case.seq_lens.tolist(), 16)
    per_token = copies_by_token(plan, qsl[-1])
    copies = [sum(per_token[a:b]) for a, b in zip(qsl, qsl[1:])]
    assert sum(copies) == earlier_copies(plan) and min(copies[:3]) > 0 and copies[3] == 0
    for limit in range(max(copies), sum(copies) + 1):
        groups = token_groups(plan, qsl, limit)
        assert groups[0][0] == 0 and groups[-1][1] == qsl[-1]
        assert all(a[1] == b[0] for a, b in zip(groups, groups[1:]))  # consecutive
        assert all(end in qsl for _, end in groups)  # whole requests
        assert all(sum(per_token[first:end]) <= limit for first, end in groups)
        following = [qsl[qsl.index(end) + 1] for _, end in groups[:-1]]
        assert all(sum(per_token[first:after]) > limit
                   for (first, _), after in zip(groups, following))
    assert token_groups(plan, qsl, sum(copies)) == [(0, qsl[-1])]
    from minipic.devtools.paged_attention_case import marker_layout

    plain = segment_plan(marker_layout([""], 4, 16), [0, 40], [40], 16)  # no earlier rows
    assert plain.earlier is None and token_groups(plain, [0, 40], 1) == [(0, 40)]


def test_a_request_past_the_limit_is_cut_between_its_tokens():
    """A request that alone copies more than the limit (a long task over many documents)
    is cut inside, each piece within the limit; the requests after it start a group of
    their own."""
    case = tasks_over_spans_case()
    qsl = case.cu_seqlens_q.tolist()
    plan = segment_plan(case.layout, qsl, case.seq_lens.tolist(), 16)
    per_token = copies_by_token(plan, qsl[-1])
    limit = sum(per_token[:33]) // 3  # request 0: 33 tokens over five spans, 165 copies
    groups = token_groups(plan, qsl, limit)
    cuts = [end for _, end in groups]
    assert cuts[:3] == [11, 22, 33]  # each token copies once per span: 5 x 11 = 55
    assert all(sum(per_token[first:end]) <= limit for first, end in groups)
    assert token_groups(plan, qsl, 1)[0] == (0, 1)  # a token over the limit: a group alone


def grouped_answer(case, limit: int, new_keys=None):
    """The batch's attention planned in token groups of at most `limit` copies (with
    `new_keys`, written first)."""
    qsl, seq_lens = case.cu_seqlens_q.tolist(), case.seq_lens.tolist()
    plan = segment_plan(case.layout, qsl, seq_lens, 16)
    groups = token_groups(plan, qsl, limit)
    batch = prepare_groups(group_plans(case.layout, qsl, seq_lens, 16, groups),
                           case.block_table, case.cos_sin, case.rotary_dim, case.is_neox)
    out = torch.full_like(case.q, float("nan"))
    grouped_attention(case.q, case.k_cache, case.v_cache, out, batch,
                      functools.partial(paged_flash_reference, scale=case.scale), new_keys)
    return groups, out


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("share", [1, 3], ids=["whole_requests", "cut_requests"])
def test_grouped_batch_matches_the_reference(seed, share):
    """Groups of whole requests, and groups that cut requests (the first in three), give the
    reference's answer; the first group's call writes every new key of the batch (turned
    into its frame) before any group reads the cache."""
    case = tasks_over_spans_case(seed)
    qsl, seq_lens = case.cu_seqlens_q.tolist(), case.seq_lens.tolist()
    plan = segment_plan(case.layout, qsl, seq_lens, 16)
    limit = sum(copies_by_token(plan, qsl[-1])[:33]) // share
    new_keys, written = case.pending_new_keys(key_turn_backs(case.layout, qsl, seq_lens, 16))
    groups, out = grouped_answer(case, limit, new_keys)
    assert len(groups) == (2 if share == 1 else 6)  # cut: requests 0 and 2
    assert written == [case.q.shape[0]]
    assert relative_error(out, reference_attention(case)) < 1e-5


def test_shared_documents_in_groups_match_the_reference():
    """Requests sharing documents read them in one row inside a group; across groups each
    group reads them itself. Either way, the reference's answer."""
    case = shared_documents_case(dtype=torch.float32, query_lens=(20, 1, 20))
    qsl = case.cu_seqlens_q.tolist()
    plan = segment_plan(case.layout, qsl, case.seq_lens.tolist(), 16)
    for limit in (earlier_copies(plan) // 4, earlier_copies(plan) - 1):
        groups, out = grouped_answer(case, limit)
        assert len(groups) > 1
        assert relative_error(out, reference_attention(case)) < 1e-5


def test_another_block_table_moves_each_groups_rows():
    """vLLM's update_block_table: each group's row tables follow the new table's rows of
    its own requests (a request cut between groups in both)."""
    case = tasks_over_spans_case()
    qsl, seq_lens = case.cu_seqlens_q.tolist(), case.seq_lens.tolist()
    plan = segment_plan(case.layout, qsl, seq_lens, 16)
    groups = token_groups(plan, qsl, sum(copies_by_token(plan, qsl[-1])[:33]) // 2)
    batch = prepare_groups(group_plans(case.layout, qsl, seq_lens, 16, groups),
                           case.block_table, case.cos_sin, case.rotary_dim, case.is_neox)
    assert [g.first_request for g in batch.groups][:2] == [0, 0]
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
    (16.1 KiB each) may take what the batch's up projection output took in vLLM's profile
    run (56 KiB a token); under tensor parallelism each rank holds its share of the MLP
    and of the heads; never fewer than MIN_COPY_LIMIT, also without an MLP size."""
    assert copy_limit(16384, 14336, 1, 32, 128, 2) == 56899
    assert copy_limit(16384, 14336, 2, 16, 128, 2) == 56899  # half the MLP, half the heads
    assert copy_limit(65536, 14336, 2, 32, 128, 2) == 113798
    assert copy_limit(256, 14336, 1, 32, 128, 2) == MIN_COPY_LIMIT
    assert copy_limit(16384, None, 1, 32, 128, 2) == MIN_COPY_LIMIT
    assert copy_limit(16384, [16384] * 30, 1, 8, 256, 2) == MIN_COPY_LIMIT  # one per layer


def test_a_groups_layout_is_its_requests_rows_of_every_table():
    """Every per-request table of the layout (span ids too: requests sharing a document
    read it once only where their ids say so) is sliced; what was derived is not shared."""
    from minipic.attention.plan_groups import _requests

    case = shared_documents_case(dtype=torch.float32)
    layout = case.layout
    segment_plan(layout, case.cu_seqlens_q.tolist(), case.seq_lens.tolist(), 16)
    assert layout.derived
    part = _requests(layout, 1, 3)
    assert not part.derived
    for name in ("span_of", "context_pos", "shift", "frame_offset", "links_end",
                 "link_tokens", "span_id"):
        assert torch.equal(getattr(part, name), getattr(layout, name)[1:3]), name
