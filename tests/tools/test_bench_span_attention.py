"""tools/bench_span_attention.py's batch of shared documents: it must be what the engine
would run (each document's blocks one set of cache blocks, span ids on span blocks only),
or the final-step timing measures another batch. The timing itself needs a GPU."""

import importlib.util
from pathlib import Path

import pytest
import torch

from minipic.attention.segment_plan import segment_plan
from minipic.devtools.paged_attention_case import marker_layout

_spec = importlib.util.spec_from_file_location(
    "bench_span_attention", Path(__file__).parents[2] / "tools" / "bench_span_attention.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

BLOCK = bench.BLOCK


def batch(name: str):
    markers, reqs, q_len, seq_len, *pool = bench.BATCHES[name]
    blocks = -(-seq_len // BLOCK)
    layout = marker_layout([markers[:blocks]] * reqs, blocks, BLOCK)
    return markers[:blocks], reqs, q_len, seq_len, pool, layout


def test_shared_documents_alias_only_documents():
    markers, reqs, _, _, (pool,), layout = batch("final481_shared")
    table, span_id = bench.shared_documents(reqs, markers, pool, torch.Generator().manual_seed(0))
    in_span = span_id >= 0
    assert (layout.span_of[in_span] >= 0).all() and in_span.any(dim=1).all()
    doc_blocks = pool * 6
    assert (table[in_span] < doc_blocks).all() and (table[~in_span] >= doc_blocks).all()
    own = table[~in_span].tolist()
    assert len(set(own)) == len(own), "a request's own block is another's"
    # a span id names one cache block wherever the document sits
    assert torch.equal(table[in_span].long(), span_id[in_span])
    # a request holds distinct documents, and documents repeat across requests
    first_blocks = table[:, [i for i, c in enumerate(markers) if c == "S"]] // 6
    assert all(len(set(row)) == row.numel() for row in first_blocks)
    assert first_blocks.unique().numel() < first_blocks.numel()


@pytest.mark.parametrize("name", ["final481", "final481_shared"])
def test_final_step_plan_reads_shared_documents_once(name):
    markers, reqs, q_len, seq_len, pool, layout = batch(name)
    if pool:
        _, layout.span_id = bench.shared_documents(reqs, markers, pool[0],
                                                   torch.Generator().manual_seed(0))
    plan = segment_plan(layout, [i * q_len for i in range(reqs + 1)], [seq_len] * reqs, BLOCK)
    span_rows = plan.earlier.cu_seqlens_q.numel() - 1
    if pool:  # one row per distinct document, holding every request's queries of it
        assert plan.earlier.max_seqlen_q > q_len
        assert span_rows == (layout.span_id[:, [i for i, c in enumerate(markers) if c == "S"]]
                             .unique().numel())
    else:
        assert plan.earlier.max_seqlen_q == q_len and span_rows == reqs * markers.count("S")
