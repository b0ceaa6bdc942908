"""Without markers minipic changes nothing: stock, off and on give the same tokens.

"stock" runs with the plugin not loaded at all in the engine processes
(VLLM_PLUGINS names none, and the engine is spawned, not forked from this
process, which earlier tests may have patched), "off" loads it without
switching it on, "on" switches it on and sends prompts without markers.
"""

from __future__ import annotations

import contextlib
import os

import pytest
from conftest import MINIPIC_ON, start_llm, stop_llm
from hf_reference import BlockAttentionReference

pytestmark = pytest.mark.engine
PROMPTS = [list(range(10, 20)), list(range(30, 130)), [1] + list(range(200, 263)), list(range(7, 300, 3))]
STEPS = 8


def greedy_run(model: str, **overrides):
    expect_patched = overrides.pop("expect_patched", True)
    # The engine's GIL switch interval in seconds (None: not checked; "off" inherits
    # whatever this process has)
    expect_switch_s = overrides.pop("expect_switch_s", None)
    with _env(VLLM_ALLOW_INSECURE_SERIALIZATION="1"):  # collective_rpc of a test function
        return _greedy_run(model, expect_patched, expect_switch_s, **overrides)


def _greedy_run(model: str, expect_patched: bool, expect_switch_s: float | None,
                **overrides):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = start_llm(model, **overrides)
    try:
        assert llm.collective_rpc(_rope_init_is_patched) == [expect_patched]
        if expect_switch_s is not None:
            assert llm.collective_rpc(_switch_interval) == [pytest.approx(expect_switch_s)]
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


def _rope_init_is_patched(worker) -> bool:
    """In the engine's worker: is minipic's patch of vLLM installed there?"""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    return hasattr(RotaryEmbeddingBase.__init__, "__minipic_original__")


def _switch_interval(worker) -> float:
    import sys

    return sys.getswitchinterval()


@contextlib.contextmanager
def _env(**values: str):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def stock(tiny_model):
    from vllm.plugins import load_general_plugins

    # vLLM loads plugins once a process: minipic is loaded here first, so that the
    # no-plugin setting reaches the spawned engine only, not the engines this process
    # starts later (their start-up refusals and engine-core hooks run here).
    load_general_plugins()
    # Engine processes load no plugin at all, and start from a fresh interpreter.
    with _env(VLLM_PLUGINS="no-plugin", VLLM_WORKER_MULTIPROC_METHOD="spawn"):
        return greedy_run(tiny_model, expect_patched=False, expect_switch_s=0.005)


def test_stock_engine_leaves_minipic_loaded_here(stock):
    """The stock engine's VLLM_PLUGINS=no-plugin must not keep minipic out of this process:
    in-process engines started after this file (test_switch_interval.py's engine core;
    test_config_refusals.py when run after it) need its patches here. It can fail only
    where this file is the first in the process to load vLLM's plugins."""
    assert _rope_init_is_patched(None)


def test_off_equals_stock_exactly(tiny_model, stock):
    assert greedy_run(tiny_model) == stock


def test_on_without_markers_equals_stock(tiny_model, stock):
    # minipic's GIL switch interval (minipic/switch_interval.py), stock's Python default
    on = greedy_run(tiny_model, **MINIPIC_ON, expect_switch_s=0.0002)
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
