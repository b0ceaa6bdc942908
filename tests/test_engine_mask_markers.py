"""minipic's mask_markers option on a real engine: marker and padding keys hidden from
everything outside their span, and taking no room (every token stands as many positions
earlier as there are such tokens before it), for Block-Attention and EPIC prompts."""

from __future__ import annotations

import pytest
import torch
from conftest import BLOCK_SIZE, start_llm, stop_llm
from hf_reference import (
    BlockAttentionReference, block_mask, epic_mask_and_positions, quiet_taking_no_room,
)
from test_engine_spans import (
    DOCS, EPIC_DOCS, LOGPROB_ATOL, STEPS, assert_same_output, build, epic_prompt,
    generate, prefill, split_final, words,
)

from minipic.protocol import SpanProtocol

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def llm(tiny_model):
    llm = start_llm(tiny_model, additional_config={"minipic": {"mask_markers": True}})
    yield llm
    stop_llm(llm)


@pytest.fixture(scope="module")
def reference(tiny_model):
    return BlockAttentionReference(tiny_model)


def quiet_reference(reference, prompt, protocol, allowed, positions, no_room=True,
                    own_span=True):
    moved_allowed, moved = quiet_taking_no_room(prompt.final, allowed, positions, protocol,
                                                own_span)
    return reference.greedy_masked(prompt.final, moved_allowed, moved if no_room else positions,
                                   STEPS)


def test_block_attention_markers_and_padding_hidden_and_taking_no_room(llm, reference):
    protocol = SpanProtocol.from_tokenizer(llm.get_tokenizer())
    prompt = build(protocol, docs=[DOCS[1], DOCS[0]], task=words(9, 60))
    prefill(llm, prompt)
    [out] = generate(llm, [prompt.vllm_final()])
    assert out.num_cached_tokens == prompt.expected_cached_tokens
    spans, task = split_final(prompt, protocol)
    allowed = block_mask([len(s) for s in spans], len(prompt.final))
    positions = torch.arange(len(prompt.final))
    tokens, logprobs = quiet_reference(reference, prompt, protocol, allowed, positions)
    assert_same_output(out, tokens, logprobs)
    # Guards: hidden but taking room, hidden from their own span too, and plain
    # Block-Attention, give other logprobs.
    _, taking_room = quiet_reference(reference, prompt, protocol, allowed, positions,
                                     no_room=False)
    _, hidden_in_span = quiet_reference(reference, prompt, protocol, allowed, positions,
                                        own_span=False)
    _, unmasked = reference.greedy(spans, task, STEPS)
    for other in (taking_room, hidden_in_span, unmasked):
        assert max(abs(a - b) for a, b in zip(logprobs, other)) > 10 * LOGPROB_ATOL


def test_epic_markers_and_padding_hidden_and_taking_no_room(llm, reference):
    """EPIC's links, spans and task in one logical sequence without markers and padding:
    every document tail hits, and the answer is the reference's."""
    protocol = SpanProtocol.from_tokenizer(llm.get_tokenizer())
    prompt = epic_prompt(protocol)
    prefill(llm, prompt)
    [out] = generate(llm, [prompt.vllm_final()])
    assert out.num_cached_tokens == prompt.expected_cached_tokens
    header = len(prompt.span_prefills[0])
    spans = [len(s) for s in prompt.span_prefills[1:1 + len(EPIC_DOCS)]]
    links = [min(n, BLOCK_SIZE) for n in spans]
    task = len(prompt.final) - header - sum(spans) - sum(links)
    allowed, positions = epic_mask_and_positions(header, spans, links, task)
    tokens, logprobs = quiet_reference(reference, prompt, protocol, allowed, positions)
    assert_same_output(out, tokens, logprobs)
    _, taking_room = quiet_reference(reference, prompt, protocol, allowed, positions,
                                     no_room=False)
    _, hidden_in_span = quiet_reference(reference, prompt, protocol, allowed, positions,
                                        own_span=False)
    for other in (taking_room, hidden_in_span):
        assert max(abs(a - b) for a, b in zip(logprobs, other)) > 10 * LOGPROB_ATOL


def test_spans_computed_inside_a_final_prompt_serve_later_prompts(llm, reference):
    """Spans that miss are computed inside the final prompt (the span path, not the stock
    attention a span prefilled alone gets): the answer is the reference's, and the KV they
    leave under their span hashes serves the documents reordered, as spans prefilled alone
    do."""
    protocol = SpanProtocol.from_tokenizer(llm.get_tokenizer())
    docs = [words(45, 61), words(30, 62)]  # in no other test: they miss
    for order, task_seed in ((docs, 63), (docs[::-1], 64)):
        prompt = build(protocol, docs=order, task=words(9, task_seed))
        [out] = generate(llm, [prompt.vllm_final()])  # no span prefills
        spans, _ = split_final(prompt, protocol)
        allowed = block_mask([len(s) for s in spans], len(prompt.final))
        tokens, logprobs = quiet_reference(reference, prompt, protocol, allowed,
                                           torch.arange(len(prompt.final)))
        assert_same_output(out, tokens, logprobs)
    # The second order hit the header and both spans the first one computed.
    assert out.num_cached_tokens == prompt.expected_cached_tokens
