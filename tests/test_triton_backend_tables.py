"""minipic's Triton metadata builder: span tables and link shifts per batch (CPU, no kernel).

The kernel itself is checked under the interpreter (test_triton_kernel_interpreter.py);
here, what the builder hands it: a batch without markers gets no tables (the stock-shaped
launch), a batch with links gets its tables and per-token shifts, and rows a link batch
wrote are rewritten by the next batch (the buffers are static, for CUDA graphs).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder  # noqa: E402

from minipic.attention import triton_backend as tb  # noqa: E402
from minipic.attention.span_layout import token_shifts, visible_keys  # noqa: E402
from minipic.devtools.paged_attention_case import marker_layout  # noqa: E402

BLOCK = 16
MAX_SEQS, MAX_BLOCKS = 4, 12


@pytest.fixture
def builder(monkeypatch):
    """The builder past vLLM's own part: its static tables, and build() on a stub metadata."""
    monkeypatch.setattr(TritonAttentionMetadataBuilder, "build",
                        lambda self, *args, **kwargs: SimpleNamespace())
    built = object.__new__(tb.MiniPICTritonMetadataBuilder)
    built.block_size = BLOCK
    built.tables = tb._plain_layout(MAX_SEQS, MAX_BLOCKS, BLOCK, "cpu")
    return built


def build(builder, monkeypatch, markers: list[str], query_lens: list[int], seq_lens: list[int]):
    monkeypatch.setattr(tb, "current_layout",
                        lambda num_reqs, block_size: marker_layout(markers, MAX_BLOCKS, BLOCK))
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    common = SimpleNamespace(num_reqs=len(seq_lens), query_start_loc=starts,
                             query_start_loc_cpu=starts,
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32))
    return builder.build(0, common)


def test_plain_batches_launch_without_tables(builder, monkeypatch):
    md = build(builder, monkeypatch, ["", ""], [5, 1], [40, 17])
    assert not md.minipic_has_spans and md.minipic_token_shift is None
    assert tb._span_tables(md) == {}  # HAS_SPAN_TABLES off: the stock-shaped launch


def test_a_link_batch_gets_its_tables_and_token_shifts(builder, monkeypatch):
    markers = ["-S-S-LLP", "-SLP"]
    md = build(builder, monkeypatch, markers, [42, 3], [122, 43])
    layout = marker_layout(markers, MAX_BLOCKS, BLOCK)
    assert torch.equal(md.minipic_tables.span_of[:2], layout.span_of)
    assert torch.equal(md.minipic_tables.context_pos[:2], layout.context_pos)
    # links end after blocks 6 and 2; two link blocks and one
    assert md.minipic_tables.links_end[:2].tolist() == [7 * BLOCK, 3 * BLOCK]
    assert md.minipic_tables.link_tokens[:2].tolist() == [2 * BLOCK, BLOCK]
    assert torch.equal(md.minipic_token_shift,
                       token_shifts(layout, [0, 42, 45], [122, 43], BLOCK))
    assert md.minipic_token_shift.any()
    tables = tb._span_tables(md)
    assert tables["span_of"] is builder.tables.span_of and tables["span_block_size"] == BLOCK
    assert tables["links_end"] is builder.tables.links_end


def test_a_plain_batch_rewrites_the_rows_a_link_batch_left(builder, monkeypatch):
    build(builder, monkeypatch, ["-S-S-LLP", "-SL"], [42, 3], [122, 43])
    build(builder, monkeypatch, ["", ""], [5, 1], [40, 17])
    # What a captured graph would read now: plain causal attention, no links.
    seen = visible_keys(builder.tables, 0, 122, 122, BLOCK)
    assert torch.equal(seen, torch.ones(122, 122, dtype=torch.bool).tril())
    assert not builder.tables.links_end.any() and not builder.tables.link_tokens.any()
