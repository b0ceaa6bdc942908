"""minipic's span_scale option on a real engine: a query outside spans gives every key of
an SSep span span_scale times its weight (APE's scale; those keys were computed alone),
links and the task their full weight, checked against the HF reference with that weight
written into its attention mask."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import BLOCK_SIZE, start_llm, stop_llm
from hf_reference import BlockAttentionReference, epic_mask_and_positions, quiet_taking_no_room
from test_engine_spans import EPIC_DOCS, LOGPROB_ATOL, STEPS, assert_same_output, epic_prompt
from test_engine_spans import generate, prefill

from minipic.protocol import SpanProtocol

pytestmark = pytest.mark.engine

SCALE = 0.5


@pytest.fixture(scope="module")
def llm(tiny_model):
    llm = start_llm(tiny_model, additional_config={
        "minipic": {"mask_markers": True, "span_scale": SCALE}})
    yield llm
    stop_llm(llm)


def span_bias(header: int, spans: list[int], n: int, scale: float) -> torch.Tensor:
    """[n, n]: log(scale) where a query after the spans (a link or the task) meets a span
    key, from segment lengths (independent of minipic's span_key_bias)."""
    bias = torch.zeros(n, n)
    spans_end = header + sum(spans)
    bias[spans_end:, header:spans_end] = math.log(scale)
    return bias


def test_epic_task_and_links_weight_span_keys_by_span_scale(llm, tiny_model):
    protocol = SpanProtocol.from_tokenizer(llm.get_tokenizer())
    prompt = epic_prompt(protocol)
    prefill(llm, prompt)
    [out] = generate(llm, [prompt.vllm_final()], ignore_eos=True)
    assert out.num_cached_tokens == prompt.expected_cached_tokens  # every span hit
    header = len(prompt.span_prefills[0])
    spans = [len(s) for s in prompt.span_prefills[1:1 + len(EPIC_DOCS)]]
    links = [min(n, BLOCK_SIZE) for n in spans]
    task = len(prompt.final) - header - sum(spans) - sum(links)
    allowed, positions = epic_mask_and_positions(header, spans, links, task)
    allowed, positions = quiet_taking_no_room(prompt.final, allowed, positions, protocol)
    reference = BlockAttentionReference(tiny_model)
    n = len(prompt.final)
    tokens, logprobs = reference.greedy_masked(prompt.final, allowed, positions, STEPS,
                                               span_bias(header, spans, n, SCALE))
    assert_same_output(out, tokens, logprobs)
    # what the option changes: at weight 1 (the option dropped) the answer is another one
    _, unscaled = reference.greedy_masked(prompt.final, allowed, positions, STEPS)
    assert max(abs(a - b) for a, b in zip(logprobs, unscaled)) > 10 * LOGPROB_ATOL


def test_decodes_batched_together_weight_span_keys_alike(llm):
    """Two requests decoding together take the torch backend's batched short-query path:
    each gets the answer it gets alone, the weight included."""
    protocol = SpanProtocol.from_tokenizer(llm.get_tokenizer())
    prompt = epic_prompt(protocol)
    prefill(llm, prompt)
    [alone] = generate(llm, [prompt.vllm_final()], ignore_eos=True)
    together = generate(llm, [prompt.vllm_final()] * 2, ignore_eos=True)
    for out in together:
        assert list(out.outputs[0].token_ids) == list(alone.outputs[0].token_ids)
        assert [next(iter(lp.values())).logprob for lp in out.outputs[0].logprobs] \
            == pytest.approx([next(iter(lp.values())).logprob
                              for lp in alone.outputs[0].logprobs], abs=LOGPROB_ATOL)
