"""The segment plan (span batches as FlashAttention rows merged by log-sum-exp) against
the independent reference, on CPU: the rows run through `paged_flash_reference`, which
computes what `flash_attn_varlen_func` does. The GPU tests run the same plans on FA3."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from minipic.attention.segment_attention import paged_flash_reference, prepare, segment_attention
from minipic.attention import segment_plan as segment_plan_module
from minipic.attention.segment_plan import JOINT_OWN_KEYS, segment_plan
from minipic.devtools.paged_attention_case import (epic_markers, make_case, random_segments,
                                                   reference_attention, relative_error,
                                                   shared_documents_case)

# (query_lens, context_lens, markers per request; None: random spans and PDep blocks)
CASES = {
    "spans_mixed": ([1, 70, 37, 1, 50], [50, 133, 0, 400, 0], None),
    "spans_decode": ([1, 1, 1], [300, 31, 517], None),
    "epic_hit_and_decode": ([160 + 40, 1, 1, 7], [16 + 640, 800, 16 + 288 + 96 + 50, 20],
                            [epic_markers(10, 4, 1, 3), epic_markers(3, 12, 2, 8),
                             epic_markers(3, 6, 2, 5), ""]),
    "epic_whole_prompt": ([16 + 288 + 96 + 50, 130], [0, 0],
                          [epic_markers(3, 6, 2, 5), epic_markers(2, 3, 1, 2)]),
    "epic_chunk_inside_links": ([40, 3], [16 + 6 * 16 * 3 + 8, 16 + 3 * 16 * 2 + 20],
                                [epic_markers(3, 6, 2, 5), epic_markers(2, 3, 1, 2)]),
}


def run_plan(case, flash=paged_flash_reference):
    layout = case.layout
    seq_lens = case.seq_lens.tolist()
    plan = segment_plan(layout, case.cu_seqlens_q.tolist(), seq_lens, case.block_size)
    out = torch.full_like(case.q, float("nan"))
    segment_attention(case.q, case.k_cache, case.v_cache, out, ready(case, plan),
                      functools.partial(flash, scale=case.scale))
    return plan, out


def ready(case, plan):
    return prepare(plan, case.block_table, case.cos_sin, case.rotary_dim, case.is_neox)


def build(name, seed=0, **kwargs):
    query_lens, context_lens, markers = CASES[name]
    if markers is None:
        rng = random.Random(f"{name}{seed}")
        markers = [random_segments(q + c, 16, rng) for q, c in zip(query_lens, context_lens)]
    return make_case(query_lens, context_lens, num_q_heads=kwargs.get("num_q_heads", 6),
                     num_kv_heads=kwargs.get("num_kv_heads", 2), head_size=32,
                     dtype=torch.float32, seed=seed, markers=markers,
                     is_neox=kwargs.get("is_neox", True))


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_plan_matches_reference(name, seed):
    case = build(name, seed)
    assert case.layout.frame_offset.any()
    plan, out = run_plan(case)
    assert relative_error(out, reference_attention(case)) < 1e-5
    assert plan.own.query_index.tolist() == list(range(case.q.shape[0]))


@pytest.mark.parametrize("name", ["epic_hit_and_decode", "spans_mixed"])
def test_gqa_and_gptj_rotation(name):
    case = build(name, num_q_heads=8, num_kv_heads=1, is_neox=False)
    _, out = run_plan(case)
    assert relative_error(out, reference_attention(case)) < 1e-5


def test_a_task_after_cached_spans_reads_each_span_in_its_frame():
    """The EPIC hit: the task's own row holds header, links and task (one frame), and one
    non-causal row per cached span tail, its queries turned back by the span's start."""
    case = build("epic_hit_and_decode")
    plan, _ = run_plan(case)
    rows = plan.earlier
    first_query = rows.query_index[rows.cu_seqlens_q[:-1].long()]
    task = (rows.row_request == 0) & (first_query >= 160)  # request 0: 10 links, then the task
    assert int(task.sum()) == 10  # ten documents, each read in its own frame
    # Each document: 4 blocks, the first replaced by its link, so 3 tail blocks.
    assert rows.seqused_k[task].tolist() == [3 * 16] * 10
    layout = case.layout
    span_starts = sorted(set(layout.frame_offset[0][layout.span_of[0] >= 0].tolist()))
    turns = rows.query_turn[rows.cu_seqlens_q[:-1].long()][task]
    assert sorted(turns.tolist()) == [s + int(layout.link_tokens[0]) for s in span_starts]
    # The k-th link reads the k - 1 documents before it: 45 rows, and 10 for the task.
    assert int((rows.row_request == 0).sum()) == 45 + 10


def test_earlier_rows_are_needed():
    """Dropping the non-causal rows (the spans) gives another answer: the test can fail."""
    case = build("epic_hit_and_decode")
    plan, out = run_plan(case)
    plan.earlier = None
    alone = torch.empty_like(case.q)
    segment_attention(case.q, case.k_cache, case.v_cache, alone, ready(case, plan),
                      functools.partial(paged_flash_reference, scale=case.scale))
    assert relative_error(alone, reference_attention(case)) > 1e-2


@pytest.mark.parametrize("name, calls", [("spans_decode", 1), ("epic_hit_and_decode", 2)])
def test_a_decode_batch_is_one_flash_call(name, calls):
    """One query per run: the causal and non-causal rows agree, so a decode batch's rows go
    as one call (one FlashAttention launch a layer); a batch with a longer run keeps two."""
    case = build(name)
    seen = []

    def counted(*args, **kwargs):
        seen.append(kwargs["causal"])
        return paged_flash_reference(*args, **kwargs)

    plan, out = run_plan(case, counted)
    assert (plan.joint is not None) == (calls == 1)
    assert len(seen) == calls
    assert relative_error(out, reference_attention(case)) < 1e-5


def test_a_plain_request_is_one_causal_row_without_turns():
    case = make_case([5, 1], [40, 64], num_q_heads=4, num_kv_heads=2, head_size=32,
                     dtype=torch.float32, markers=["-S-P", "----"])
    plan, out = run_plan(case)
    plain = plan.own.row_request == 1
    assert int(plain.sum()) == 1
    assert not plan.own.query_turn[plan.own.query_index == 5].any()
    assert plan.earlier is None or not (plan.earlier.row_request == 1).any()
    assert relative_error(out, reference_attention(case)) < 1e-5


def test_quiet_keys_are_refused():
    case = build("spans_decode")
    case.layout.quiet = torch.zeros(3, 600, dtype=torch.bool)
    with pytest.raises(ValueError, match="quiet keys"):
        segment_plan(case.layout, case.cu_seqlens_q.tolist(), case.seq_lens.tolist(), 16)


def test_a_span_computed_after_its_header_is_one_turned_row():
    """A span's queries see their span only: one causal row in the span's frame, no
    earlier rows, the FlashAttention call writing the output itself."""
    case = make_case([32], [16], num_q_heads=4, num_kv_heads=2, head_size=32,
                     dtype=torch.float32, markers=["-S-"])
    plan, out = run_plan(case)
    assert plan.earlier is None
    assert plan.own.query_turn.tolist() == [16] * 32  # the span starts at 16
    assert relative_error(out, reference_attention(case)) < 1e-5


@pytest.mark.parametrize("name", ["epic_hit_and_decode", "epic_whole_prompt",
                                  "epic_chunk_inside_links"])
def test_link_shifts_folded_into_the_turns(name):
    """The backend hands the rows the model's Q: a link token's Q, at its index, is turned
    to its logical position in the same rotation as into its row's frame."""
    from minipic.attention.rotation import Rotation
    from minipic.attention.span_layout import token_shifts

    case = build(name)
    shifts = token_shifts(case.layout, case.cu_seqlens_q.tolist(), case.seq_lens.tolist(), 16)
    assert shifts is not None and shifts.any()
    model_q = Rotation.at(shifts, case.cos_sin, case.rotary_dim, case.is_neox,
                          pure=True).apply(case.q).to(case.q.dtype)  # before the turn-back
    plan = segment_plan(case.layout, case.cu_seqlens_q.tolist(), case.seq_lens.tolist(), 16,
                        link_shifts=True)
    out = torch.empty_like(case.q)
    segment_attention(model_q, case.k_cache, case.v_cache, out, ready(case, plan),
                      functools.partial(paged_flash_reference, scale=case.scale))
    assert relative_error(out, reference_attention(case)) < 1e-5
    without = torch.empty_like(case.q)
    # without the shifts in the turns the same queries give other answers
    plain = segment_plan(case.layout, case.cu_seqlens_q.tolist(), case.seq_lens.tolist(), 16)
    segment_attention(model_q, case.k_cache, case.v_cache, without, ready(case, plain),
                      functools.partial(paged_flash_reference, scale=case.scale))
    assert relative_error(without, reference_attention(case)) > 1e-3


@pytest.mark.parametrize("name", ["spans_decode", "epic_hit_and_decode"])
def test_another_block_table_moves_every_row_table(name):
    """vLLM's update_block_table: the same batch over other physical blocks (the joint
    call's table too) gives the same answer from the moved caches."""
    from minipic.attention.segment_attention import with_block_table

    case = build(name)
    plan, out = run_plan(case)
    blocks = case.k_cache.shape[0]
    moved_to = torch.randperm(blocks, generator=torch.Generator().manual_seed(1))
    k_moved, v_moved = torch.empty_like(case.k_cache), torch.empty_like(case.v_cache)
    k_moved[moved_to], v_moved[moved_to] = case.k_cache, case.v_cache
    table = moved_to[case.block_table.long()].to(case.block_table.dtype)
    batch = with_block_table(ready(case, plan), table)
    again = torch.empty_like(case.q)
    segment_attention(case.q, k_moved, v_moved, again, batch,
                      functools.partial(paged_flash_reference, scale=case.scale))
    assert torch.allclose(again, out)


@pytest.mark.parametrize("seed", [0, 1])
def test_requests_sharing_documents_read_them_in_one_row(seed):
    """Decode over shared documents: each shared span tail is one row holding both
    requests' queries, each turned by its own span offset; the answer is the reference's."""
    case = shared_documents_case(dtype=torch.float32, seed=seed)
    plan, out = run_plan(case)
    assert relative_error(out, reference_attention(case)) < 1e-5
    earlier = plan.earlier
    # request 1's three document tails alone, one row each for the two shared ones
    assert earlier.row_request.tolist().count(1) == 3
    shared = (earlier.cu_seqlens_q[1:] - earlier.cu_seqlens_q[:-1]) == 2
    assert int(shared.sum()) == 2 and earlier.row_request.numel() == 5
    assert set(earlier.row_request[shared].tolist()) == {0}
    case.layout.span_id = None  # unknown identity: a row per request and span, same answer
    unshared, out_unshared = run_plan(case)
    assert unshared.earlier.row_request.numel() == 7
    assert relative_error(out_unshared, out) < 1e-6


def test_sharing_keeps_each_querys_own_turn():
    """The shared row's queries turn by different amounts (the spans sit one block apart):
    one turn for both would be wrong, and the test sees it."""
    case = shared_documents_case(dtype=torch.float32)
    plan = segment_plan(case.layout, case.cu_seqlens_q.tolist(), case.seq_lens.tolist(),
                        case.block_size)
    earlier, n = plan.earlier, case.q.shape[0]
    sizes = (earlier.cu_seqlens_q[1:] - earlier.cu_seqlens_q[:-1]).tolist()
    for row, size in enumerate(sizes):
        if size == 2:
            start = int(earlier.cu_seqlens_q[row])
            turns = earlier.query_turn[start: start + 2].tolist()
            assert turns[1] - turns[0] == 16  # request 2's span stands one block later
            # the decode batch's one call reads its turns from the joint rows (own first)
            plan.joint.query_turn[n + start + 1] = turns[0]  # one turn for both
    out = torch.empty_like(case.q)
    segment_attention(case.q, case.k_cache, case.v_cache, out, ready(case, plan),
                      functools.partial(paged_flash_reference, scale=case.scale))
    assert relative_error(out, reference_attention(case)) > 1e-2


def test_prefill_runs_over_shared_documents_share_rows():
    """Two tasks prefilled after hits on the same documents (several queries each): their
    rows merge too, and the one FlashAttention call (short tasks: each query a causal row of
    its own) gives the reference's answer."""
    case = shared_documents_case(dtype=torch.float32, query_lens=(20, 1, 20))
    plan, out = run_plan(case)
    assert plan.joint is not None
    assert relative_error(out, reference_attention(case)) < 1e-5
    sizes = (plan.earlier.cu_seqlens_q[1:] - plan.earlier.cu_seqlens_q[:-1]).tolist()
    assert sorted(sizes)[-2:] == [40, 40]


@pytest.mark.parametrize("budget, calls", [(JOINT_OWN_KEYS, 1), (0, 2)])
def test_a_short_task_after_cached_spans_is_one_flash_call(budget, calls, monkeypatch):
    """A span hit's question (a few dozen queries after the header and the spans): its
    causal row goes as rows of one query each beside the spans' rows, one call a layer;
    with no budget for that, two calls. Both give the reference's answer."""
    monkeypatch.setattr(segment_plan_module, "JOINT_OWN_KEYS", budget)
    # a header block, ten 4-block spans, then the question (3 blocks, its last one partial);
    # beside it, a decode step
    case = make_case([33, 1], [16 * 41, 200], num_q_heads=4, num_kv_heads=2, head_size=32,
                     dtype=torch.float32, seed=3,
                     markers=["-" + "S---" * 10 + "P--", "-S" + "-" * 11])
    seen = []

    def counted(*args, **kwargs):
        seen.append(kwargs["causal"])
        return paged_flash_reference(*args, **kwargs)

    plan, out = run_plan(case, counted)
    assert int((plan.earlier.row_request == 0).sum()) == 10  # one row per cached span
    assert len(seen) == calls
    assert relative_error(out, reference_attention(case)) < 1e-5


@pytest.mark.parametrize("budget", [JOINT_OWN_KEYS, 0])
def test_a_joint_plan_moves_its_call_and_merge_only(budget, monkeypatch):
    """Beside a joint call only its rows and the merge tables go to the device (the own
    and earlier rows stay where they were built); a two-call plan moves all of its rows."""
    monkeypatch.setattr(segment_plan_module, "JOINT_OWN_KEYS", budget)
    case = make_case([33], [16 * 41], num_q_heads=4, num_kv_heads=2, head_size=32,
                     dtype=torch.float32, seed=3, markers=["-" + "S---" * 10 + "P--"])
    plan = segment_plan(case.layout, case.cu_seqlens_q.tolist(), case.seq_lens.tolist(), 16)
    moved = plan.to("meta")
    on_meta = {name: all(t.is_meta for t in getattr(moved, name).tensors().values())
               for name in ("own", "earlier")}
    assert moved.merge_starts.is_meta and moved.merge_entries.is_meta
    if budget:
        assert all(t.is_meta for t in moved.joint.tensors().values())
        assert on_meta == {"own": False, "earlier": False}
        assert moved.own is plan.own and moved.earlier is plan.earlier
    else:
        assert moved.joint is None and on_meta == {"own": True, "earlier": True}


def test_new_keys_are_turned_and_written_before_the_rows_read_them():
    """The backend leaves a rows batch's cache write to segment_attention (NewKeys): the
    batch's own keys, as the model made them (at their indices), reach the cache turned
    into their frames before any row reads them."""
    from minipic.attention.span_layout import key_turn_backs

    case = build("epic_hit_and_decode")
    qsl, seq_lens = case.cu_seqlens_q.tolist(), case.seq_lens.tolist()
    turn = key_turn_backs(case.layout, qsl, seq_lens, 16)
    assert turn is not None and turn.any()
    new_keys, written = case.pending_new_keys(turn)
    plan = segment_plan(case.layout, qsl, seq_lens, 16)
    out = torch.empty_like(case.q)
    segment_attention(case.q, case.k_cache, case.v_cache, out, ready(case, plan),
                      functools.partial(paged_flash_reference, scale=case.scale), new_keys)
    assert written == [case.q.shape[0]]
    assert relative_error(out, reference_attention(case)) < 1e-5


@pytest.mark.parametrize("budget", [JOINT_OWN_KEYS, 0])
@pytest.mark.parametrize("tokens", [16, 17, 18, 19])
def test_every_moved_table_starts_16_byte_aligned(budget, tokens, monkeypatch):
    """The plan reaches the device as one packed copy per dtype; each table in it starts
    16-byte aligned whatever the sizes before it, as Triton compiles a kernel again for a
    pointer whose alignment differs from the last launch's (a stall mid-run)."""
    monkeypatch.setattr(segment_plan_module, "JOINT_OWN_KEYS", budget)
    case = make_case([tokens, 3], [16 * 41, 16 * 9], num_q_heads=4, num_kv_heads=2,
                     head_size=32, dtype=torch.float32, seed=tokens,
                     markers=["-" + "S---" * 10 + "P--", "-" + "S---" * 2 + "P--"])
    plan = segment_plan(case.layout, case.cu_seqlens_q.tolist(), case.seq_lens.tolist(), 16)
    moved = plan.to("cpu")
    tables, host = plan_tables(moved), plan_tables(plan)
    assert {name: t.data_ptr() % 16 for name, t in tables.items()} == dict.fromkeys(tables, 0)
    assert all(torch.equal(tables[name], host[name]) for name in tables)


def plan_tables(plan) -> dict:
    """The tables a plan moves to the device, by name (SegmentPlan.to)."""
    tables = {"merge_starts": plan.merge_starts, "merge_entries": plan.merge_entries}
    for which in ("joint",) if plan.joint is not None else ("own", "earlier"):
        tables.update({f"{which}.{name}": t
                       for name, t in getattr(plan, which).tensors().items()})
    return tables
