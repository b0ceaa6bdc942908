"""A full decode graph's rows (graph_rows.py) against the independent reference, on CPU:
the same batch written into fixed-capacity buffers, with padding requests after the real
ones and empty rows after the plan's, must attend as the exact plan does (the rows run
through `paged_flash_reference`, what FlashAttention computes; the GPU e2e tests replay
the captured graphs on FA3)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from minipic.attention import graph_dispatch, graph_rows, span_layout
from minipic.attention.graph_rows import GraphRows, GraphShape, earlier_capacity
from minipic.attention.host_prompts import HostPrompts
from minipic.attention.segment_attention import paged_flash_reference, segment_attention
from minipic.attention.segment_plan import segment_plan
from minipic.devtools.paged_attention_case import (MARKER_TOKENS, MARKERS, epic_markers,
                                                   make_case, marker_layout,
                                                   reference_attention, relative_error,
                                                   shared_documents_case)

PADDING = 3  # the graph's batch size is the real requests' plus this


def graph_attention(case, plan, num_reqs):
    """`case`'s decode batch through a graph of num_reqs requests: output [num_reqs, ...]."""
    n = case.q.shape[0]
    rows = GraphRows(num_reqs + 2, 0, case.block_table.shape[1], 4096, case.rotary_dim,
                     case.is_neox, torch.device("cpu"))
    table = torch.zeros(num_reqs, case.block_table.shape[1], dtype=case.block_table.dtype)
    table[:n] = case.block_table
    batch, _ = rows.fill(GraphShape(num_reqs), plan, case.seq_lens.tolist(), None, table, 16,
                         case.cos_sin)
    query = torch.cat([case.q, torch.randn(num_reqs - n, *case.q.shape[1:]).to(case.q.dtype)])
    out = torch.full_like(query, float("nan"))
    segment_attention(query, case.k_cache, case.v_cache, out, batch,
                      functools.partial(paged_flash_reference, scale=case.scale))
    return out, batch


def marker_prompts(markers: list[str]) -> HostPrompts:
    """Host prompts whose blocks start as `markers` says (make_case), 3 tokens short of
    their last block's end."""
    prompts = HostPrompts(MARKERS)
    for row, m in enumerate(markers):
        tokens = np.full(16 * len(m) - 3, 7, dtype=np.int64)
        tokens[::16] = [MARKER_TOKENS[c] for c in m]
        prompts.add(row, tokens)
    return prompts


def decode_plan(case):
    return segment_plan(case.layout, case.cu_seqlens_q.tolist(), case.seq_lens.tolist(), 16)


@pytest.mark.parametrize("seed", [0, 1])
def test_shared_documents_decode_in_the_graph_as_in_the_plan(seed):
    case = shared_documents_case(torch.float32, seed=seed)
    plan = decode_plan(case)
    assert plan.earlier is not None and plan.joint is not None
    out, batch = graph_attention(case, plan, case.q.shape[0] + PADDING)
    n = case.q.shape[0]
    assert relative_error(out[:n], reference_attention(case)) < 1e-5
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))  # padding: no keys, no NaN
    # the graph's shapes are its capacity's, whatever the batch
    assert batch.turn_index.numel() == n + PADDING + earlier_capacity(n + PADDING)
    assert int(batch.turn_count) == n + PADDING + plan.earlier.query_index.numel()


def test_epic_decode_in_the_graph_as_in_the_plan():
    markers = [epic_markers(4, 3, 1, 2), epic_markers(2, 5, 1, 3), "---P"]
    seq_lens = [16 * len(m) - 3 for m in markers]
    case = make_case([1, 1, 1], [s - 1 for s in seq_lens], num_q_heads=8, num_kv_heads=2,
                     head_size=32, dtype=torch.float32, markers=markers)
    out, _ = graph_attention(case, decode_plan(case), 3 + PADDING)
    assert relative_error(out[:3], reference_attention(case)) < 1e-5


def test_a_plain_batch_in_the_graph_is_causal_attention():
    case = make_case([1, 1], [70, 200], num_q_heads=4, num_kv_heads=2, head_size=32,
                     dtype=torch.float32)
    out, batch = graph_attention(case, None, 2 + PADDING)
    assert relative_error(out[:2], reference_attention(case)) < 1e-5
    assert not batch.turn.sin[:2].any()  # turned by 0: stock attention


def test_a_graph_batch_binds_no_launches_that_outlive_its_step():
    """vLLM keeps every graph's metadata until the whole capture ends: a launch cache in
    its batch would hold each graph's last-layer tensors at once (GraphRows._batch)."""
    case = make_case([1, 1], [70, 200], num_q_heads=4, num_kv_heads=2, head_size=32,
                     dtype=torch.float32)
    _, batch = graph_attention(case, None, 2 + PADDING)
    assert batch.launches is None


def test_the_graph_without_the_earlier_rows_gives_another_answer():
    """The graph must hold the plan's earlier rows: the test can fail."""
    case = shared_documents_case(torch.float32)
    plan = decode_plan(case)
    plan.earlier = plan.joint = None
    out, _ = graph_attention(case, plan, 3 + PADDING)
    assert relative_error(out[:3], reference_attention(case)) > 1e-2


def test_a_batch_past_the_capacity_is_refused(monkeypatch):
    case = shared_documents_case(torch.float32)
    monkeypatch.setattr(graph_rows, "GRAPH_EARLIER_TOKENS_PER_REQUEST", 1)
    with pytest.raises(RuntimeError, match="does not fit the CUDA graph"):
        graph_attention(case, decode_plan(case), 3)


def test_the_dispatch_check_counts_each_requests_need_and_skips_plain_batches(monkeypatch):
    """The check before vLLM picks a full graph: each prompt's need alone, summed, against
    the plan of the batch; a batch without spans stays with stock's attention."""
    monkeypatch.setattr(span_layout, "_protocol", MARKERS)
    monkeypatch.setattr(graph_dispatch, "_block_size", 16)
    markers = [epic_markers(4, 3, 1, 2), epic_markers(2, 5, 1, 3), "---P", "----"]
    prompts, lens = marker_prompts(markers), [16 * len(m) - 3 for m in markers]
    runner = SimpleNamespace(minipic_host_prompts=prompts, req_states=SimpleNamespace(
        req_id_to_index={"a": 0, "b": 1, "c": 2, "d": 3}))
    layout = marker_layout(markers[:3], max(-(-s // 16) + 1 for s in lens), 16)
    plan = segment_plan(layout, [0, 1, 2, 3], [s + 1 for s in lens[:3]], 16)
    assert plan.earlier.query_index.numel() == 4 + 2  # a row per cached document
    takes = graph_dispatch.takes_full_graph
    assert takes(runner, ["a", "b", "c"], 4)  # 6 <= 4 * 32
    monkeypatch.setattr(graph_rows, "GRAPH_EARLIER_TOKENS_PER_REQUEST", 1)
    assert not takes(runner, ["a", "b", "c"], 4)  # 6 > 4
    monkeypatch.setattr(graph_rows, "GRAPH_EARLIER_TOKENS_PER_REQUEST", 2)
    assert takes(runner, ["a", "b", "c"], 3)  # 6 <= 6
    assert not takes(runner, ["c", "d"], 3)  # no spans: stock's attention, piecewise
    assert not takes(runner, ["a", "x"], 3)  # a request the runner does not hold


def test_the_dispatch_patch_picks_the_full_graph_only_for_span_batches_that_fit(monkeypatch):
    """minipic's wrappers of execute_model and of vLLM's own CudaGraphManager.dispatch: a
    span batch that fits keeps the full decode graph and is noted for the builder, one past
    the capacity or without spans gets the piecewise graph, a dummy run the full graph with
    every request padding; the note is cleared after the step."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu import cudagraph_utils

    from minipic import _vllm_patches

    monkeypatch.setattr(span_layout, "_protocol", MARKERS)
    monkeypatch.setattr(graph_dispatch, "_block_size", 16)
    monkeypatch.setattr(_vllm_patches, "is_enabled", lambda config: True)
    prompts = marker_prompts([epic_markers(4, 3, 1, 2), "---P"])
    desc = cudagraph_utils.BatchExecutionDescriptor
    full = desc(CUDAGraphMode.FULL, num_tokens=2, num_reqs=2, uniform_token_count=1)
    piecewise = desc(CUDAGraphMode.PIECEWISE, num_tokens=2, num_reqs=None)
    manager = object.__new__(cudagraph_utils.CudaGraphManager)
    manager._graphs_captured, manager._candidates = True, {(2, 0): [full, piecewise]}
    manager._lora_dispatch_map, manager._max_lora_case = {}, 0
    stock_dispatch = getattr(cudagraph_utils.CudaGraphManager.dispatch, "__minipic_original__",
                             cudagraph_utils.CudaGraphManager.dispatch)
    dispatch = _vllm_patches._full_graph_dispatch(stock_dispatch)
    seen = []

    def stock_execute(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
        picked = dispatch(manager, 2, 2, 1, num_active_loras=0)
        seen.append((picked.cg_mode, graph_dispatch.graph_step()))

    execute = _vllm_patches._full_graph_execute_model(stock_execute)
    runner = SimpleNamespace(vllm_config=None, minipic_host_prompts=prompts,
                             req_states=SimpleNamespace(req_id_to_index={"s": 0, "p": 1}))

    def step(req_ids, **kwargs):
        execute(runner, SimpleNamespace(num_scheduled_tokens=dict.fromkeys(req_ids, 1)),
                **kwargs)
        assert graph_dispatch.graph_step() is None  # cleared after the step
        return seen[-1]

    assert step(["s", "p"]) == (CUDAGraphMode.FULL, 2)
    assert step(["p"]) == (CUDAGraphMode.PIECEWISE, None)  # no spans
    assert step(["s", "p"], dummy_run=True) == (CUDAGraphMode.FULL, 0)
    monkeypatch.setattr(graph_rows, "GRAPH_EARLIER_TOKENS_PER_REQUEST", 1)
    assert step(["s", "p"]) == (CUDAGraphMode.PIECEWISE, None)  # 4 > 2: past the capacity


def test_a_prefill_in_a_prefill_graph_as_in_the_plan():
    """A short prefill's rows go as one call of one-query rows (segment_plan._joint): the
    graph holds them as a decode batch's, its own rows the query tokens, padding tokens
    after them (a span hit's question in a prefill graph, graph_dispatch.py)."""
    case = shared_documents_case(dtype=torch.float32, query_lens=(20, 1, 20))
    plan = decode_plan(case)
    assert plan.joint is not None and plan.earlier is not None
    tokens = case.q.shape[0]
    shape = GraphShape(tokens + PADDING, prefill=True)
    rows = GraphRows(2, shape.rows, case.block_table.shape[1], 4096, case.rotary_dim,
                     case.is_neox, torch.device("cpu"))
    table = case.block_table.clone()  # the prefill graph's requests are the batch's
    batch, _ = rows.fill(shape, plan, case.seq_lens.tolist(), None, table, 16, case.cos_sin)
    query = torch.cat([case.q, torch.randn(PADDING, *case.q.shape[1:]).to(case.q.dtype)])
    out = torch.full_like(query, float("nan"))
    segment_attention(query, case.k_cache, case.v_cache, out, batch,
                      functools.partial(paged_flash_reference, scale=case.scale))
    assert relative_error(out[:tokens], reference_attention(case)) < 1e-5
    assert torch.equal(out[tokens:], torch.zeros_like(out[tokens:]))
    assert batch.turn_index.numel() == shape.rows + earlier_capacity(shape.rows, prefill=True)


def test_a_causal_prefill_plan_is_refused():
    """Own rows of several queries (a prefill whose rows are not one query each: no
    earlier rows, or too many keys to split) cannot go in a graph's one-query rows."""
    case = make_case([20], [70], num_q_heads=4, num_kv_heads=2, head_size=32,
                     dtype=torch.float32, markers=["S--S--"])
    plan = decode_plan(case)
    plan.joint = None
    rows = GraphRows(2, 32, case.block_table.shape[1], 4096, case.rotary_dim, case.is_neox,
                     torch.device("cpu"))
    with pytest.raises(ValueError, match="one query each"):
        rows.fill(GraphShape(32, prefill=True), plan, case.seq_lens.tolist(), None,
                  case.block_table, 16, case.cos_sin)
