"""Span batches on vLLM's own FlashAttention (segment_plan + segment_attention) on a CUDA
GPU: against the fp64 torch reference and against minipic's Triton span kernel, on the
span, EPIC link and decode batches the kernel tests use."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from minipic.attention import triton_kernel as tk
from minipic.attention.segment_attention import prepare, segment_attention, vllm_flash_rows
from minipic.attention.segment_plan import segment_plan
from minipic.devtools.paged_attention_case import (epic_markers, make_case, random_segments,
                                                   reference_attention, relative_error,
                                                   shared_documents_case)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TOLERANCE = {torch.bfloat16: 1.5e-2, torch.float16: 4e-3}
# (query_lens, context_lens, markers; None: random spans and PDep blocks)
BATCHES = {
    "spans_mixed": ([1, 200, 37, 1, 150], [50, 133, 0, 1000, 0], None),
    "spans_decode": ([1, 1, 1], [1000, 31, 4097], None),
    "epic_hit_and_decode": ([160 + 40, 1, 1, 7], [16 + 640, 800, 16 + 288 + 96 + 50, 20],
                            [epic_markers(10, 4, 1, 3), epic_markers(3, 12, 2, 8),
                             epic_markers(3, 6, 2, 5), ""]),
    "epic_whole_prompt": ([16 + 288 + 96 + 50, 130], [0, 0],
                          [epic_markers(3, 6, 2, 5), epic_markers(2, 3, 1, 2)]),
    "hit_40_docs": ([50], [16 + 40 * 1008], ["-" + ("S" + "-" * 62) * 40 + "P"]),
    # a long task chunk after three spans: 2112 tokens x 32 heads take the merge's other
    # launch shape (segment_kernels.merge_launch_shape)
    "long_task_after_spans": ([2112], [16 + 3 * 160],
                              ["-" + ("S" + "-" * 9) * 3 + "P" + "-" * 131]),
}


def rows_batch(case):
    plan = segment_plan(case.layout.to("cpu"), case.cu_seqlens_q.tolist(),
                        case.seq_lens.tolist(), case.block_size)
    return prepare(plan, case.block_table, case.cos_sin, case.rotary_dim, case.is_neox)


def run_rows(case):
    """The batch's answer for case.q, after checking that its next layer (other queries,
    the launches bound by the first reused) gives what a batch of its own gives them."""
    batch = rows_batch(case)
    flash = functools.partial(vllm_flash_rows, scale=case.scale, fa_version=3)
    out = torch.full_like(case.q, float("nan"))
    segment_attention(case.q, case.k_cache, case.v_cache, out, batch, flash)
    next_q = torch.randn_like(case.q)
    reused, alone = torch.full_like(out, float("nan")), torch.full_like(out, float("nan"))
    segment_attention(next_q, case.k_cache, case.v_cache, reused, batch, flash)
    segment_attention(next_q, case.k_cache, case.v_cache, alone, rows_batch(case), flash)
    torch.cuda.synchronize()
    assert batch.launches and all(launch.binds == 1 for launch in batch.launches.values())
    assert torch.equal(reused, alone) and not torch.equal(reused, out)
    return out


def run_kernel(case):
    out = torch.full_like(case.q, float("nan"))
    split = tk.split_kv_buffers(tk.SPLIT_KV_MAX_TOKENS, case.q.shape[1], case.q.shape[2], "cuda")
    tk.unified_attention_rope(
        case.q, case.k_cache, case.v_cache, out, cu_seqlens_q=case.cu_seqlens_q,
        seqused_k=case.seq_lens, max_seqlen_q=case.max_seqlen_q, block_table=case.block_table,
        softmax_scale=case.scale, cos_sin=case.cos_sin, rotary_dim=case.rotary_dim,
        is_neox_style=case.is_neox, split_output=split[0], split_max=split[1],
        split_expsum=split[2], seq_threshold_3d=16,
        **tk.span_table_args(case.layout, case.block_size))
    torch.cuda.synchronize()
    return out


def build(name, dtype, num_q_heads=32, num_kv_heads=8, head_size=128, seed=0):
    query_lens, context_lens, markers = BATCHES[name]
    if markers is None:
        rng = random.Random(f"{name}{seed}")
        markers = [random_segments(q + c, 16, rng) for q, c in zip(query_lens, context_lens)]
    return make_case(query_lens, context_lens, num_q_heads=num_q_heads,
                     num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype,
                     device="cuda", seed=seed, markers=markers)


@pytest.mark.parametrize("name", sorted(BATCHES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_rows_on_fa3_match_reference_and_kernel(name, dtype):
    case = build(name, dtype)
    ours = run_rows(case)
    ref = reference_attention(case)
    err = relative_error(ours, ref)
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"
    assert relative_error(ours, run_kernel(case)) < TOLERANCE[dtype]


@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_size",
                         [(8, 1, 64), (6, 2, 128), (16, 16, 256)], ids=["mqa8", "group3", "mha256"])
def test_head_shapes(num_q_heads, num_kv_heads, head_size):
    case = build("epic_hit_and_decode", torch.bfloat16, num_q_heads, num_kv_heads, head_size)
    assert relative_error(run_rows(case), reference_attention(case)) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_key_turn_before_the_cache_write_matches_torch(dtype):
    """New keys turned into their frames in one Triton launch (links.turn_back_tokens on
    CUDA), read from rows as strided as the model's fused QKV output, as torch turns them."""
    from minipic.attention.rotation import Rotation
    from minipic.attention.segment_kernels import turn_rows

    case = build("spans_mixed", dtype)
    tokens, kv_heads, head_size = 300, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(1)
    qkv = torch.randn(tokens + 5, (32 + 2 * kv_heads) * head_size, generator=gen,
                      device="cuda").to(dtype)
    key = qkv[:, 32 * head_size: (32 + kv_heads) * head_size].view(-1, kv_heads, head_size)
    amounts = torch.randint(0, case.cos_sin.shape[0], (tokens,), generator=gen, device="cuda")
    turn = Rotation.back(amounts, case.cos_sin, case.rotary_dim, case.is_neox)
    ours = turn_rows(key, None, turn.cos, turn.sin, case.rotary_dim, case.is_neox)
    expected = turn.apply(key[:tokens]).to(dtype)
    assert relative_error(ours, expected) < TOLERANCE[dtype] / 10


@pytest.mark.parametrize("name", ["epic_hit_and_decode", "spans_decode"])
def test_new_keys_turned_with_the_queries_reach_the_cache_first(name):
    """A rows batch's cache write left to segment_attention (NewKeys, what the backend does):
    the model's keys turned in the queries' launch (segment_kernels.turn_rows_and_keys),
    written before FA3 reads them; NaN in their slots otherwise reaches the output."""
    from minipic.attention.rotation import Rotation
    from minipic.attention.segment_attention import NewKeys

    case = build(name, torch.bfloat16)
    qsl, seq_lens = case.cu_seqlens_q.tolist(), case.seq_lens.tolist()
    slots = case.query_slots()
    turn = torch.randint(0, 500, (case.q.shape[0],), device="cuda")
    model_k = Rotation.at(turn, case.cos_sin, case.rotary_dim, case.is_neox,
                          pure=True).apply(case.k_cache[slots]).to(case.k_cache.dtype)
    expected = run_rows(case)  # the cache as it is

    def write(turned):
        case.k_cache[slots] = turned

    batch = rows_batch(case)
    back = Rotation.back(turn, case.cos_sin, case.rotary_dim, case.is_neox)
    flash = functools.partial(vllm_flash_rows, scale=case.scale, fa_version=3)
    assert relative_error(expected, reference_attention(case)) < TOLERANCE[torch.bfloat16]
    # The second layer reuses the first's launches on other queries and other keys.
    cached_k = torch.randn_like(case.k_cache[slots])
    other_k = Rotation.at(turn, case.cos_sin, case.rotary_dim, case.is_neox,
                          pure=True).apply(cached_k).to(case.k_cache.dtype)
    for q, layer_k, cache_k in ((case.q, model_k, case.k_cache[slots].clone()),
                                (torch.randn_like(case.q), other_k, cached_k)):
        case.k_cache[slots] = cache_k  # the keys as the reference reads them
        want = torch.full_like(q, float("nan"))
        segment_attention(q, case.k_cache, case.v_cache, want, rows_batch(case), flash)
        case.k_cache[slots] = float("nan")
        out = torch.full_like(q, float("nan"))
        segment_attention(q, case.k_cache, case.v_cache, out, batch, flash,
                          NewKeys(layer_k, back, write))
        assert relative_error(out, want) < TOLERANCE[torch.bfloat16]
    assert all(launch.binds == 1 for launch in batch.launches.values())


@pytest.mark.parametrize("query_lens", [(1, 1, 1), (20, 1, 20)], ids=["decode", "prefill"])
def test_requests_sharing_documents_on_fa3(query_lens):
    """Rows shared by requests holding the same documents (segment_plan._shared), on FA3:
    the reference's answer, and fewer rows than without sharing."""
    case = shared_documents_case(torch.bfloat16, "cuda", query_lens=query_lens,
                                 num_q_heads=32, num_kv_heads=8, head_size=128)
    plan = segment_plan(case.layout.to("cpu"), case.cu_seqlens_q.tolist(),
                        case.seq_lens.tolist(), case.block_size)
    assert plan.earlier.row_request.numel() == 5  # 7 without sharing
    ours = run_rows(case)
    assert relative_error(ours, reference_attention(case)) < TOLERANCE[torch.bfloat16]


GRAPH_HEADS = dict(num_q_heads=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16,
                   device="cuda")


def _replay_captured_rows(cases, shape, table_rows: int) -> None:
    """graph_rows: the rows' attention captured once in a CUDA graph at `shape` (every
    query padding, as vLLM captures), then replayed after each fill of a case's batch
    (`table_rows` requests in the table): each replay matches the reference, and the
    padding queries give 0."""
    from minipic.attention.graph_rows import GraphRows

    width = max(c.block_table.shape[1] for c in cases)
    # one cache for all: each case's blocks copied in at its own offset
    k_cache = torch.cat([c.k_cache for c in cases])
    v_cache = torch.cat([c.v_cache for c in cases])
    offsets = torch.tensor([0] + [c.k_cache.shape[0] for c in cases]).cumsum(0)
    rows = GraphRows(8, shape.rows * shape.prefill, width, 8192, 128, True,
                     torch.device("cuda"))
    table = torch.zeros(table_rows, width, dtype=torch.int32, device="cuda")
    query = torch.zeros(shape.rows, 32, 128, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(query)
    flash = functools.partial(vllm_flash_rows, scale=cases[0].scale, fa_version=3)
    batch, _ = rows.fill(shape, None, [], None, table, 16, cases[0].cos_sin)
    segment_attention(query, k_cache, v_cache, out, batch, flash)  # warm-up, as vLLM's
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        segment_attention(query, k_cache, v_cache, out, batch, flash)
    for i, case in enumerate(cases):
        n, reqs = case.q.shape[0], case.block_table.shape[0]
        plan = None if case.layout is None else segment_plan(
            case.layout.to("cpu"), case.cu_seqlens_q.tolist(), case.seq_lens.tolist(), 16)
        table.zero_()
        table[:reqs, : case.block_table.shape[1]] = case.block_table + offsets[i].item()
        rows.fill(shape, plan, case.seq_lens.tolist(), None, table, 16, case.cos_sin)
        query.normal_()
        query[:n] = case.q
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(out[:n], reference_attention(case)) < TOLERANCE[torch.bfloat16], i
        assert not out[n:].any(), i


def test_a_captured_decode_graph_replays_other_batches():
    """A decode graph of 6 requests over other decode batches (shared documents, EPIC,
    plain; fewer requests than the graph's)."""
    from minipic.attention.graph_rows import GraphShape

    cases = [shared_documents_case(**GRAPH_HEADS), build("spans_decode", torch.bfloat16),
             make_case([1, 1], [16 + 640, 800], **GRAPH_HEADS,
                       markers=[epic_markers(10, 4, 1, 3), epic_markers(3, 12, 2, 8)]),
             make_case([1, 1, 1], [90, 2000, 7], **GRAPH_HEADS)]
    _replay_captured_rows(cases, GraphShape(6), table_rows=6)


def test_a_captured_prefill_graph_replays_span_questions():
    """A prefill graph (one request, 48 tokens) over span hits' questions: 33 and 41
    tokens over ten and four documents."""
    from minipic.attention.graph_rows import GraphShape

    cases = [make_case([33], [16 + 10 * 96], **GRAPH_HEADS,
                       markers=["-" + "S-----" * 10 + "P--"]),
             make_case([41], [16 + 4 * 160], **GRAPH_HEADS, seed=1,
                       markers=["-" + "S---------" * 4 + "P--"])]
    _replay_captured_rows(cases, GraphShape(48, prefill=True), table_rows=1)


@pytest.mark.parametrize("limit, count", [(2 * 33 * 10, 3), (100, 20)],
                         ids=["whole_requests", "cut_requests"])
def test_finals_in_token_groups_on_fa3(limit, count):
    """Short tasks over cached spans attended in groups of query tokens (plan_groups.py,
    what a batch past its row copy limit takes), of whole requests and of requests cut
    between their tokens: the reference's answer, and one plan's."""
    from minipic.attention.plan_groups import group_plans, token_groups
    from minipic.attention.segment_attention import grouped_attention, prepare_groups

    # five tasks after ten cached spans each, a decode step over EPIC links, a plain prompt
    markers = ["-" + "S-----" * 10 + "P--"] * 5 + [epic_markers(3, 6, 2, 5), ""]
    case = make_case([33] * 5 + [1, 40], [16 + 10 * 96] * 5 + [16 + 288 + 96 + 50, 100],
                     num_q_heads=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16,
                     device="cuda", seed=2, markers=markers)
    qsl, seq_lens = case.cu_seqlens_q.tolist(), case.seq_lens.tolist()
    plan = segment_plan(case.layout.to("cpu"), qsl, seq_lens, case.block_size)
    groups = token_groups(plan, qsl, limit)
    assert len(groups) == count
    batch = prepare_groups(group_plans(case.layout.to("cpu"), qsl, seq_lens, case.block_size,
                                       groups),
                           case.block_table, case.cos_sin, case.rotary_dim, case.is_neox)
    flash = functools.partial(vllm_flash_rows, scale=case.scale, fa_version=3)
    expected = run_rows(case)  # one plan, the cache as it is
    # the first group turns every new key of the batch in its queries' launch, then writes
    turn = torch.randint(0, 500, (case.q.shape[0],), device="cuda")
    new_keys, written = case.pending_new_keys(turn)
    out = torch.full_like(case.q, float("nan"))
    grouped_attention(case.q, case.k_cache, case.v_cache, out, batch, flash, new_keys)
    assert written == [case.q.shape[0]]
    assert relative_error(out, reference_attention(case)) < TOLERANCE[torch.bfloat16]
    assert relative_error(out, expected) < TOLERANCE[torch.bfloat16]  # keys re-rounded


def compiled_variants(kernel) -> int:
    """How many variants Triton compiled of `kernel` on the current GPU (its cache holds
    one per specialization key)."""
    return len(kernel.device_caches[torch.cuda.current_device()][0])


def test_batches_of_other_sizes_reuse_the_compiled_kernels():
    """A 40-document hit with 16 to 19, 32 and 33 question tokens: row counts, row
    offsets, the LSE's strides and where each plan table starts in its packed copy are
    multiples of 16 (bytes for the tables) or not, and Triton compiles nothing again (a
    compile stalls every request of the step for about a second). The kernels' caches
    start empty: variants the file's other tests compiled would hide a new one."""
    from minipic.attention import segment_kernels

    kernels = (segment_kernels._turn_rows_kernel, segment_kernels._merge_rows_kernel)
    for kernel in kernels:
        kernel.device_caches.clear()
    markers = ["-" + ("S" + "-" * 62) * 40 + "P"]
    variants = None
    for tokens in (16, 17, 18, 19, 32, 33):
        case = make_case([tokens], [16 + 40 * 1008], num_q_heads=32, num_kv_heads=8,
                         head_size=128, dtype=torch.bfloat16, device="cuda", seed=tokens,
                         markers=markers)
        assert relative_error(run_rows(case), reference_attention(case)) < TOLERANCE[torch.bfloat16]
        variants = variants or [compiled_variants(k) for k in kernels]
        assert [compiled_variants(k) for k in kernels] == variants, tokens


def test_start_up_compiles_what_span_batches_launch():
    """After compile_variants (what a FlashAttention span builder runs as the engine
    starts) the turn and the merge of span batches compile nothing more: hits, a long
    task chunk (the merge's other launch shape), new keys turned with the queries and
    alone. The kernels' caches start empty."""
    from minipic.attention import segment_kernels
    from minipic.attention.rotation import Rotation

    kernels = (segment_kernels._turn_rows_kernel, segment_kernels._merge_rows_kernel)
    for kernel in kernels:
        kernel.device_caches.clear()
    segment_kernels.compile_variants.__wrapped__(  # past functools.cache: the test's call
        32, 8, 128, torch.bfloat16, 128, True, torch.device("cuda"), 16384)
    variants = [compiled_variants(k) for k in kernels]
    for name in ("hit_40_docs", "long_task_after_spans", "epic_hit_and_decode"):
        run_rows(build(name, torch.bfloat16))
    case = build("spans_mixed", torch.bfloat16)
    new_keys, written = case.pending_new_keys(
        torch.randint(0, 500, (case.q.shape[0],), device="cuda"))
    flash = functools.partial(vllm_flash_rows, scale=case.scale, fa_version=3)
    segment_attention(case.q, case.k_cache, case.v_cache, torch.empty_like(case.q),
                      rows_batch(case), flash, new_keys)
    assert written == [case.q.shape[0]]
    qkv = torch.randn(300, (32 + 2 * 8) * 128, device="cuda").to(torch.bfloat16)
    key = qkv[:, 32 * 128: 40 * 128].view(-1, 8, 128)  # the model's keys, strided
    turn = Rotation.back(torch.arange(300, device="cuda"), case.cos_sin, case.rotary_dim,
                         case.is_neox)
    segment_kernels.turn_rows(key, None, turn.cos, turn.sin, case.rotary_dim, case.is_neox)
    torch.cuda.synchronize()
    assert [compiled_variants(k) for k in kernels] == variants
