"""minipic.devtools.rag_workload: Table 1's workload (no engine) is what docs/benchmarks.md
says, and the same in every process."""

from __future__ import annotations

import random

import pytest

from minipic.devtools.rag_workload import DOCS_PER_SAMPLE, draw_documents, rag_workload

MARKERS = {"ssep_token_id": 128002, "pdep_token_id": 128003, "pad_token_id": 128004}


def workload(samples=200, rate=0.4, seed=0, block_size=16):
    return rag_workload("llama3-8b", samples, rate, seed, block_size, MARKERS)


def test_same_seed_same_tokens_other_seed_other_tokens():
    a, b, c = workload(), workload(), workload(seed=1)
    assert [p.final for p in a.span_prompts] == [p.final for p in b.span_prompts]
    assert a.span_prompts[0].final != c.span_prompts[0].final


@pytest.mark.parametrize("rate", [0.3, 0.4, 0.6, 0.9])
def test_repeat_rate_is_what_was_asked(rate):
    load = workload(samples=400, rate=rate)
    # Only the first sample's repeat slots can lack an earlier document to repeat.
    assert rate - 10 / 4000 <= load.repeat_rate <= rate
    assert load.unique_docs == round(4000 * (1 - load.repeat_rate))


def test_sample_shape_and_hits():
    for prompt in workload().span_prompts:
        spans = prompt.span_prefills
        assert len(prompt.final) == 64 + 10 * 96 + 32  # no padding at block size 16
        assert len(spans) == 11 and len({tuple(s) for s in spans[1:]}) == 10  # header + 10 docs
        assert prompt.expected_cached_tokens == 64 + 10 * 96  # all but the task


def test_plain_prompts_same_length_no_markers():
    load = workload(samples=20)
    for plain, prompt in zip(load.plain_prompts(), load.span_prompts):
        assert len(plain) == len(prompt.final)
        assert not set(plain) & set(MARKERS.values())


def test_repeat_window_draws_repeats_from_the_newest_documents_only():
    new_doc = iter(range(10**6)).__next__
    window = 50
    pool, chosen = draw_documents(300, 0.6, random.Random(0), new_doc, window)
    first_use = {}
    for sample in chosen:
        newest = len(first_use)  # documents seen before this sample
        for doc in sample:
            if doc in first_use:
                assert doc >= newest - window, (doc, newest)
            first_use.setdefault(doc, True)
        assert len(set(sample)) == len(sample)
    slots = 300 * DOCS_PER_SAMPLE
    assert 0.6 - 10 / slots <= (slots - len(pool)) / slots <= 0.6


def test_default_workload_is_the_one_measured_on_the_h200():
    """docs/results/table1_merged.json: seed 0, rate 0.3, 4000 samples had 28004 documents."""
    assert workload(samples=4000, rate=0.3).unique_docs == 28004
