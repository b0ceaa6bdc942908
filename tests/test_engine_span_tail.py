"""`LLM.generate` from a prompt that ends inside an SSep span: refused unless it opts in."""

from __future__ import annotations

import pytest
from conftest import BLOCK_SIZE

from minipic.span_tail import OPT_IN_KEY

pytestmark = pytest.mark.engine
SSEP, PDEP, PAD = 3, 4, 5
HEADER = [7 + i for i in range(BLOCK_SIZE)]
SPAN = [SSEP, *range(40, 80)] + [PAD] * (-41 % BLOCK_SIZE)


@pytest.fixture(scope="module")
def llm(minipic_llm):
    return minipic_llm  # shared with the next module that uses it (conftest.py)


def generate(llm, prompt, max_tokens, **extra):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **extra)
    [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return out.outputs[0].token_ids


def test_generation_from_inside_a_span_is_refused(llm):
    with pytest.raises(ValueError, match=f"ends inside the SSep span that starts at token "
                                         f"{BLOCK_SIZE}.*{OPT_IN_KEY}"):
        generate(llm, HEADER + SPAN, max_tokens=4)


def test_span_prefill_opt_in_and_task_generate(llm):
    assert len(generate(llm, SPAN + [PAD], max_tokens=1)) == 1  # a span prefill
    assert len(generate(llm, HEADER + SPAN, max_tokens=4,
                        extra_args={OPT_IN_KEY: True})) == 4
    assert len(generate(llm, HEADER + SPAN + [PDEP, 9, 10], max_tokens=4)) == 4


def test_generation_from_inside_a_link_is_refused(llm):
    """No opt-in: generated tokens would take the link's turned-back positions, which a
    replayed CUDA graph does not turn back (attention.links)."""
    link = [6, *SPAN[1:BLOCK_SIZE]]  # span 1's first block, carried by link 1
    with pytest.raises(ValueError, match=f"ends inside the EPIC link segment that starts at "
                                         f"token {BLOCK_SIZE + len(SPAN)}"):
        generate(llm, HEADER + SPAN + link, max_tokens=4, extra_args={OPT_IN_KEY: True})
    assert len(generate(llm, HEADER + SPAN + link, max_tokens=1)) == 1
    assert len(generate(llm, HEADER + SPAN + link + [PDEP, 9], max_tokens=4)) == 4
