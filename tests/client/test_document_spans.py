"""Cutting documents into spans: sizes, markers, padding, and agreement with the builder."""

from __future__ import annotations

import pytest

from minipic.client.prompts.document_spans import document_spans, span_key, span_window
from minipic.client.prompts.recipes import block_attention
from minipic.client.prompts.span_prompt import SpanPromptError
from minipic.protocol import SpanProtocol

P = SpanProtocol(3, 4, 5)


@pytest.mark.parametrize("n", [1, 30, 31, 32, 62, 63, 200])
def test_spans_cover_the_document_in_block_aligned_windows(n):
    tokens = list(range(10, 10 + n))
    spans = document_spans(tokens, protocol=P, block_size=16, span_tokens=32)
    assert all(s[0] == P.ssep_token_id and len(s) % 16 == 0 and len(s) <= 32 for s in spans)
    bodies = [[t for t in s[1:] if t != P.pad_token_id] for s in spans]
    assert [t for b in bodies for t in b] == tokens
    assert all(len(b) == 31 for b in bodies[:-1])  # every span but the last is full


def test_span_size_is_rounded_down_to_blocks():
    assert span_window(100, 32) == 96
    assert span_window(10, 32) == 32  # at least one block
    with pytest.raises(ValueError):
        span_window(1, 32)


def test_text_needs_a_tokenizer_and_must_not_be_empty():
    with pytest.raises(SpanPromptError, match="tokenizer"):
        document_spans("some text", protocol=P, block_size=16)
    with pytest.raises(SpanPromptError, match="empty"):
        document_spans([], protocol=P, block_size=16)


def test_a_marker_inside_the_text_is_refused():
    with pytest.raises(SpanPromptError, match="SSep"):
        document_spans([10, P.ssep_token_id, 11], protocol=P, block_size=16)


def test_spans_are_accepted_by_the_builder_as_prebuilt():
    spans = document_spans(list(range(10, 80)), protocol=P, block_size=16, span_tokens=32)
    prompt = block_attention(spans, [20, 21], protocol=P, block_size=16)
    assert prompt.span_prefills == spans
    assert prompt.expected_cached_tokens == sum(map(len, spans))


def test_span_key_names_the_tokens():
    assert span_key([3, 10, 5]) == span_key((3, 10, 5))
    assert span_key([3, 10, 5]) != span_key([3, 105])
