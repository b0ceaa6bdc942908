"""minipic's prefill graphs (graph_dispatch.py), on CPU: which steps take one, the plan
noted for the builder, and the graphs added beside vLLM's own. The graphs' attention is
checked against the reference in test_graph_rows.py and replayed on FA3 in the GPU e2e
test (`on_compiled`)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from minipic.attention import graph_dispatch, graph_rows, span_layout
from minipic.devtools.paged_attention_case import MARKER_TOKENS, MARKERS

QUESTION = 20
BLOCK_SIZE = 16


def _runner(markers: list[str]) -> SimpleNamespace:
    """Requests 0, 1, ... whose prompts' blocks start as `markers` says (paged_attention_case),
    3 tokens short of the last block's end, all computed but the last QUESTION tokens."""
    from minipic.attention.host_prompts import HostPrompts

    prompts, computed = HostPrompts(MARKERS), np.zeros(len(markers), dtype=np.int32)
    for row, m in enumerate(markers):
        tokens = np.full(BLOCK_SIZE * len(m) - 3, 7, dtype=np.int64)
        tokens[::BLOCK_SIZE] = [MARKER_TOKENS[c] for c in m]
        prompts.add(row, tokens)
        computed[row] = tokens.size - QUESTION
    index = {f"r{row}": row for row in range(len(markers))}
    return SimpleNamespace(minipic_host_prompts=prompts, req_states=SimpleNamespace(
        req_id_to_index=index, num_computed_tokens_np=computed))


@pytest.fixture
def runner(monkeypatch):
    monkeypatch.setattr(span_layout, "_protocol", MARKERS)
    monkeypatch.setattr(graph_dispatch, "_block_size", BLOCK_SIZE)
    graph_dispatch.note_graph_step(None)
    # a Block-Attention hit (header, three documents, the question), and a plain prompt
    return _runner(["-" + "S--" * 3 + "P--", "-" * 8])


def test_a_span_hits_question_takes_a_prefill_graph_and_its_plan_is_noted(runner):
    assert graph_dispatch.takes_prefill_graph(runner, {"r0": QUESTION}, 24)
    seq_len = int(runner.req_states.num_computed_tokens_np[0]) + QUESTION
    width = -(-seq_len // BLOCK_SIZE) * BLOCK_SIZE
    # the builder's layout is the one the check made (the same object: its cache)
    layout = span_layout.host_layout(runner.minipic_host_prompts, np.array([0], np.int32),
                                     BLOCK_SIZE, width)
    plan = graph_dispatch.prefill_plan(layout, [0, QUESTION], [seq_len])
    assert plan is not None and plan.joint is not None
    assert plan.earlier.query_index.numel() == 3 * QUESTION  # a row per document
    assert graph_dispatch.prefill_plan(layout, [0, QUESTION], [seq_len + 1]) is None
    graph_dispatch.note_graph_step(None)  # the step ends: its plan goes
    assert graph_dispatch.prefill_plan(layout, [0, QUESTION], [seq_len]) is None


def test_other_steps_run_piecewise(runner, monkeypatch):
    takes = graph_dispatch.takes_prefill_graph
    assert not takes(runner, {"r1": QUESTION}, 24)  # no spans: stock attention
    assert not takes(runner, {"r0": QUESTION, "r1": 1}, 24)  # two requests
    assert not takes(runner, {"r0": QUESTION}, 16)  # more tokens than the graph
    assert not takes(runner, {"r9": QUESTION}, 24)  # a request the runner does not hold
    monkeypatch.setattr(graph_rows, "GRAPH_EARLIER_TOKENS_PER_QUESTION_TOKEN", 2)
    assert not takes(runner, {"r0": QUESTION}, 24)  # 60 earlier row tokens > 48
    monkeypatch.setattr(graph_rows, "GRAPH_EARLIER_TOKENS_PER_QUESTION_TOKEN", 3)
    assert takes(runner, {"r0": QUESTION}, 20)  # 60 <= 60


def _descs():
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu import cudagraph_utils

    return cudagraph_utils.BatchExecutionDescriptor, CUDAGraphMode


@pytest.mark.parametrize("shared", [True, False], ids=["a_list_per_size", "a_list_per_count"])
def test_prefill_graphs_are_added_before_the_piecewise_ones(shared):
    """At each capture size from 2 to PREFILL_GRAPH_TOKENS_MAX, one request's full graph,
    tried after vLLM's decode graph and before its piecewise graph, for every token count
    that piecewise graph serves (vLLM 0.25 shares one candidate list between them, later
    releases give each count its own), and captured once."""
    from minipic import _vllm_patches

    desc, mode = _descs()
    sizes = [1, 2, 8, 24, 256]

    def candidates(size):
        return [desc(mode.FULL, size, size, uniform_token_count=1),
                desc(mode.PIECEWISE, size, None)]

    lists = {s: candidates(s) for s in sizes}
    counts = {count: next(s for s in sizes if s >= count) for count in range(1, 257)}
    manager = SimpleNamespace(
        compilation_config=SimpleNamespace(cudagraph_capture_sizes=sizes),
        _candidates={(count, 0): lists[size] if shared else candidates(size)
                     for count, size in counts.items()},
        _capture_descs={mode.FULL: [desc(mode.FULL, s, s, uniform_token_count=1)
                                    for s in reversed(sizes)]})
    _vllm_patches._add_prefill_graphs(manager)
    prefill = {d.num_tokens: d for d in manager.minipic_prefill_descs}
    assert sorted(prefill) == [2, 8, 24]  # not 1 (a decode), not past the maximum
    for count, size in counts.items():
        kinds = [(d.cg_mode, d.num_reqs) for d in manager._candidates[(count, 0)]]
        middle = [(mode.FULL, 1)] if size in prefill else []
        assert kinds == [(mode.FULL, size), *middle, (mode.PIECEWISE, None)], count
        if size in prefill:  # the one graph of that size
            assert manager._candidates[(count, 0)][1] is prefill[size]
    captured = [d.num_tokens for d in manager._capture_descs[mode.FULL]]
    assert captured == sorted(captured, reverse=True) and len(captured) == len(sizes) + 3


def test_the_dispatch_patch_replays_a_prefill_graph_only_for_a_span_question(runner,
                                                                             monkeypatch):
    from vllm.v1.worker.gpu import cudagraph_utils

    from minipic import _vllm_patches

    desc, mode = _descs()
    monkeypatch.setattr(_vllm_patches, "is_enabled", lambda config: True)
    prefill, piecewise = desc(mode.FULL, 24, 1), desc(mode.PIECEWISE, 24, None)
    manager = object.__new__(cudagraph_utils.CudaGraphManager)
    manager._graphs_captured, manager._candidates = True, {(QUESTION, 0): [prefill, piecewise],
                                                           (24, 0): [prefill, piecewise]}
    manager._lora_dispatch_map, manager._max_lora_case = {}, 0
    manager.minipic_prefill_descs = frozenset([prefill])
    stock_dispatch = getattr(cudagraph_utils.CudaGraphManager.dispatch, "__minipic_original__",
                             cudagraph_utils.CudaGraphManager.dispatch)
    dispatch = _vllm_patches._full_graph_dispatch(stock_dispatch)
    seen = []

    def stock_execute(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
        tokens = sum(scheduler_output.num_scheduled_tokens.values())
        picked = dispatch(manager, 1, tokens, tokens, num_active_loras=0)
        seen.append((picked.cg_mode, graph_dispatch.graph_step()))

    execute = _vllm_patches._full_graph_execute_model(stock_execute)
    runner.vllm_config = None

    def step(scheduled, **kwargs):
        execute(runner, SimpleNamespace(num_scheduled_tokens=scheduled), **kwargs)
        assert graph_dispatch.graph_step() is None  # cleared after the step
        return seen[-1]

    assert step({"r0": QUESTION}) == (mode.FULL, 1)
    assert step({"r1": QUESTION}) == (mode.PIECEWISE, None)  # no spans
    assert step({"r0": QUESTION}, dummy_run=True) == (mode.FULL, 0)
    # a decode of a plain prompt (stock attention) finds a decode graph, which the check
    # refuses: the piecewise graph, never the prefill graph after it, which nothing fills
    decode = desc(mode.FULL, 24, 24, uniform_token_count=1)
    manager._candidates[(1, 0)] = [decode, prefill, piecewise]
    assert step({"r1": 1}) == (mode.PIECEWISE, None)


@pytest.mark.parametrize("option, mode, wanted", [
    (True, "FULL_AND_PIECEWISE", None),  # then the rows' full graphs decide (FA3, MRV2)
    (False, "FULL_AND_PIECEWISE", False),  # the default: no prefill graphs
    (True, "PIECEWISE", False),  # no full graphs at all
    (True, "FULL_DECODE_ONLY", False)])  # prefills eager: nothing to replay them among
def test_prefill_graphs_are_captured_only_when_asked_for_in_the_default_mode(
        monkeypatch, option, mode, wanted):
    from minipic.attention import cuda_backend

    _, modes = _descs()
    monkeypatch.setattr(cuda_backend, "_full_decode_graphs", lambda config, head_size: None)
    config = SimpleNamespace(
        kv_transfer_config=None, model_config=SimpleNamespace(get_head_size=lambda: 128),
        additional_config={"minipic": {"prefill_graphs": option}})
    assert cuda_backend.prefill_graphs_wanted(config, getattr(modes, mode)) is wanted
