"""tools/bench_span_attention.py's batch of shared documents: it must be what the engine
would run (each document's blocks one set of cache blocks, span ids on span blocks only,
as Model Runner V2 gives them), or the final-step timing measures another batch. The
timing itself needs a GPU."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from minipic.attention.segment_plan import segment_plan
from minipic.attention.span_identity import SpanIds
from minipic.devtools.paged_attention_case import MARKER_TOKENS, marker_layout

_spec = importlib.util.spec_from_file_location(
    "bench_span_attention", Path(__file__).parents[2] / "tools" / "bench_span_attention.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

BLOCK = bench.BLOCK


def shape(name: str):
    found = bench.BATCHES[name]
    return found._replace(markers=found.markers[: -(-found.seq_len // BLOCK)])


def documents(markers: str) -> list[int]:
    return [i for i, c in enumerate(markers) if c == "S"]


def test_documents_share_cache_blocks_exactly_where_span_ids_are_equal():
    s = shape("final481_shared")
    table, span_id = bench.shared_documents(s.requests, s.markers, s.pool,
                                            torch.Generator().manual_seed(0))
    in_span = span_id >= 0
    layout = marker_layout([s.markers] * s.requests, len(s.markers), BLOCK)
    assert torch.equal(in_span, layout.span_of >= 0)
    assert table.max() < s.requests * len(s.markers)  # the batch's cache holds them
    pairs = set(zip(table.flatten().tolist(), span_id.flatten().tolist()))
    assert len({block for block, _ in pairs}) == len(pairs)  # a cache block: one span id
    shared = {(block, ident) for block, ident in pairs if ident >= 0}
    assert len({ident for _, ident in shared}) == len(shared)  # a span id: one cache block
    own = table[~in_span].tolist()  # header and task blocks: each a block of its own
    assert len(set(own)) == len(own) and set(own).isdisjoint(table[in_span].tolist())
    first = span_id[:, documents(s.markers)]
    assert all(len(set(row)) == row.numel() for row in first)  # distinct documents a request
    assert first.unique().numel() < first.numel()  # and shared between requests


def test_span_ids_are_model_runner_v2s():
    """SpanIds.take over the token prompts the table stands for gives ids equal exactly
    where the bench's are."""
    s, requests, pool = shape("final481_shared"), 50, 20
    _, span_id = bench.shared_documents(requests, s.markers, pool,
                                        torch.Generator().manual_seed(1))
    rng = np.random.default_rng(0)
    words: dict[int, np.ndarray] = {}  # a span block's tokens, by its id

    def block_tokens(marker: str, ident: int) -> list[int]:
        body = words.setdefault(ident, rng.integers(100, 30000, BLOCK)) if ident >= 0 \
            else rng.integers(100, 30000, BLOCK)
        return list(body) if marker == "-" else [MARKER_TOKENS[marker], *body[1:]]

    ssep, pdep = MARKER_TOKENS["S"], MARKER_TOKENS["P"]
    prompts = [np.array([t for b, c in enumerate(s.markers)
                         for t in block_tokens(c, int(span_id[r, b]))], dtype=np.int64)
               for r in range(requests)]
    ids = SpanIds()
    theirs = torch.stack([torch.from_numpy(ids.take(p, BLOCK, ssep, {ssep, pdep})[0])
                          for p in prompts])
    assert torch.equal(theirs >= 0, span_id >= 0)
    pairs = set(zip(span_id[span_id >= 0].tolist(), theirs[theirs >= 0].tolist()))
    assert len({a for a, _ in pairs}) == len({b for _, b in pairs}) == len(pairs)


@pytest.mark.parametrize("name", ["final481", "final481_shared"])
def test_final_step_plan_reads_shared_documents_once(name):
    s = shape(name)
    layout = marker_layout([s.markers] * s.requests, len(s.markers), BLOCK)
    if s.pool is not None:
        _, layout.span_id = bench.shared_documents(s.requests, s.markers, s.pool,
                                                   torch.Generator().manual_seed(0))
    q = s.query_tokens
    plan = segment_plan(layout, [i * q for i in range(s.requests + 1)],
                        [s.seq_len] * s.requests, BLOCK)
    span_rows = plan.earlier.cu_seqlens_q.numel() - 1
    if s.pool is not None:  # one row per distinct document, holding every request's queries
        assert plan.earlier.max_seqlen_q > q
        assert span_rows == layout.span_id[:, documents(s.markers)].unique().numel()
    else:
        assert plan.earlier.max_seqlen_q == q
        assert span_rows == s.requests * len(documents(s.markers))
