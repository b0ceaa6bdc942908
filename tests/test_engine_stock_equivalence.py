"""Without markers minipic changes nothing: stock, off and on give the same tokens.

"stock" runs with the plugin not loaded at all in the engine processes
(VLLM_PLUGINS names none), "off" loads it without switching it on, "on"
switches it on and sends prompts without markers.
"""

from __future__ import annotations

import os

import pytest
from conftest import MINIPIC_ON, start_llm, stop_llm
from hf_reference import BlockAttentionReference

pytestmark = pytest.mark.engine
PROMPTS = [list(range(10, 20)), list(range(30, 130)), [1] + list(range(200, 263)), list(range(7, 300, 3))]
STEPS = 8


def greedy_run(model: str, **overrides):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = start_llm(model, **overrides)
    try:
        params = SamplingParams(max_tokens=STEPS, temperature=0.0, logprobs=0)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params,
                            use_tqdm=False)
        # Run twice: the second pass is served from the prefix cache.
        again = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params,
                             use_tqdm=False)
    finally:
        stop_llm(llm)
    return [(list(o.outputs[0].token_ids),
             [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
             o.num_cached_tokens) for o in outs + again]


@pytest.fixture(scope="module")
def stock(tiny_model):
    saved = os.environ.get("VLLM_PLUGINS")
    os.environ["VLLM_PLUGINS"] = "no-plugin"  # engine processes load no plugin at all
    try:
        return greedy_run(tiny_model)
    finally:
        if saved is None:
            del os.environ["VLLM_PLUGINS"]
        else:
            os.environ["VLLM_PLUGINS"] = saved


def test_off_equals_stock_exactly(tiny_model, stock):
    assert greedy_run(tiny_model) == stock


def test_on_without_markers_equals_stock(tiny_model, stock):
    on = greedy_run(tiny_model, **MINIPIC_ON)
    for (tokens, logprobs, cached), (s_tokens, s_logprobs, s_cached) in zip(on, stock):
        assert tokens == s_tokens
        assert cached == s_cached  # same hashes: the same prefix-cache hits
        assert logprobs == pytest.approx(s_logprobs, abs=1e-4)


def test_stock_engine_equals_hf_causal(tiny_model, stock):
    """Validates the HF reference the fidelity tests rely on."""
    reference = BlockAttentionReference(tiny_model)
    for prompt, (tokens, logprobs, _) in zip(PROMPTS, stock):
        ref_tokens, ref_logprobs = reference.greedy([], prompt, STEPS)
        assert tokens == ref_tokens
        assert logprobs == pytest.approx(ref_logprobs, abs=2e-3)
