"""minipic's mask_markers option on a real engine: marker and padding keys hidden."""

from __future__ import annotations

import pytest
import torch
from conftest import start_llm, stop_llm
from hf_reference import BlockAttentionReference, block_mask
from test_engine_spans import (
    DOCS, LOGPROB_ATOL, STEPS, assert_same_output, build, generate, prefill, split_final, words,
)

from minipic.protocol import SpanProtocol

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def llm(tiny_model):
    llm = start_llm(tiny_model, additional_config={"minipic": {"mask_markers": True}})
    yield llm
    stop_llm(llm)


def quiet_reference(reference, prompt, protocol) -> tuple[list[int], list[float]]:
    """Block-Attention's mask, less every marker and padding key (each still sees itself)."""
    spans, task = split_final(prompt, protocol)
    allowed = block_mask([len(s) for s in spans], len(prompt.final))
    quiet = torch.tensor([t in protocol.markers | {protocol.pad_token_id} for t in prompt.final])
    allowed &= ~quiet[None, :] | torch.eye(len(prompt.final), dtype=torch.bool)
    return reference.greedy_masked(prompt.final, allowed, torch.arange(len(prompt.final)), STEPS)


def test_marker_and_pad_keys_are_hidden(llm, tiny_model):
    protocol = SpanProtocol.from_tokenizer(llm.get_tokenizer())
    reference = BlockAttentionReference(tiny_model)
    prompt = build(protocol, docs=[DOCS[1], DOCS[0]], task=words(9, 60))
    prefill(llm, prompt)
    [out] = generate(llm, [prompt.vllm_final()])
    assert out.num_cached_tokens == prompt.expected_cached_tokens
    tokens, logprobs = quiet_reference(reference, prompt, protocol)
    assert_same_output(out, tokens, logprobs)
    # Guard: the masked reference differs from plain Block-Attention.
    spans, task = split_final(prompt, protocol)
    _, unmasked = reference.greedy(spans, task, STEPS)
    assert max(abs(a - b) for a, b in zip(logprobs, unmasked)) > 10 * LOGPROB_ATOL
