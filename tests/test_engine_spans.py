"""minipic on a real vLLM CPU engine: span hits, fidelity, PDep, cache_salt, sharing."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import BLOCK_SIZE
from hf_reference import BlockAttentionReference, epic_mask_and_positions

from minipic.client import block_attention
from minipic.protocol import SpanProtocol

pytestmark = pytest.mark.engine
FIRST_WORD_ID = 7  # ids below are <unk>, <s>, </s> and the reserved markers
STEPS = 6


def _logprob_tolerance() -> float:
    # vLLM's platform check does not initialise CUDA (engines fork after it).
    from vllm.platforms import current_platform

    # On CUDA, Triton's fp32 tl.dot runs in TF32 (10-bit mantissa).
    return 1e-2 if current_platform.is_cuda() else 2e-3


LOGPROB_ATOL = _logprob_tolerance()


@pytest.fixture(scope="module")
def llm(minipic_llm):
    return minipic_llm  # shared with the next module that uses it (conftest.py)


@pytest.fixture(scope="module")
def protocol(llm) -> SpanProtocol:
    return SpanProtocol.from_tokenizer(llm.get_tokenizer())


@pytest.fixture(scope="module")
def reference(tiny_model) -> BlockAttentionReference:
    return BlockAttentionReference(tiny_model)


def words(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(FIRST_WORD_ID, 400) for _ in range(n)]


DOCS = [words(40, 1), words(70, 2), words(25, 3)]  # 2, 3 and 1 blocks once wrapped
TASK = words(9, 4)


def generate(llm, prompts, steps=STEPS, **params):
    from vllm import SamplingParams

    sampling = SamplingParams(max_tokens=steps, temperature=0.0, logprobs=0, **params)
    return llm.generate(prompts, sampling, use_tqdm=False)


def prefill(llm, prompt) -> None:
    generate(llm, prompt.vllm_prefills(), steps=1)


def build(protocol, docs=DOCS, system=words(20, 5), task=TASK):
    return block_attention(docs, task, system=system, protocol=protocol,
                           block_size=BLOCK_SIZE)


def split_final(prompt, protocol) -> tuple[list[list[int]], list[int]]:
    """`prompt.final` as (header and document spans, PDep task), cut at marker blocks."""
    final, starts = prompt.final, [0]
    for b in range(BLOCK_SIZE, len(final), BLOCK_SIZE):
        if final[b] in protocol.markers:
            starts.append(b)
    task_start = starts.pop() if final[starts[-1]] == protocol.pdep_token_id else len(final)
    bounds = starts + [task_start]
    return [final[a:b] for a, b in zip(bounds, bounds[1:])], final[task_start:]


def assert_same_output(out, tokens: list[int], logprobs: list[float]) -> None:
    """The engine's greedy tokens and their logprobs are the reference's."""
    assert list(out.outputs[0].token_ids) == tokens
    got = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)]
    assert got == pytest.approx(logprobs, abs=LOGPROB_ATOL)


def expected_tokens(reference, prompt, protocol) -> tuple[list[int], list[float]]:
    spans, task = split_final(prompt, protocol)
    return reference.greedy(spans, task, STEPS)


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1), (1, 2, 0)])
@pytest.mark.parametrize("system_words", [20, 50], ids=["1-block-system", "2-block-system"])
def test_spans_hit_in_any_order_and_offset(llm, protocol, order, system_words):
    spans_alone = build(protocol, docs=DOCS)
    prefill(llm, spans_alone)
    prompt = build(protocol, docs=[DOCS[i] for i in order], system=words(system_words, 5))
    prefill(llm, block_attention([], TASK, system=words(system_words, 5), protocol=protocol,
                                 block_size=BLOCK_SIZE))  # the header only
    [out] = generate(llm, [prompt.vllm_final()])
    assert prompt.expected_cached_tokens == len(prompt.final) - (len(TASK) + 1)
    assert out.num_cached_tokens == prompt.expected_cached_tokens


def test_block_attention_fidelity_vs_hf_block_mask(llm, protocol, reference):
    prompt = build(protocol, docs=[DOCS[2], DOCS[0], DOCS[1]])
    prefill(llm, prompt)
    [out] = generate(llm, [prompt.vllm_final()])
    assert out.num_cached_tokens == prompt.expected_cached_tokens
    tokens, logprobs = expected_tokens(reference, prompt, protocol)
    assert_same_output(out, tokens, logprobs)


def test_span_prefilled_in_context_differs_from_alone(llm, protocol, reference):
    """Guards the reference: full causal attention gives other tokens than Block-Attention."""
    prompt = build(protocol, docs=[DOCS[1], DOCS[0]], task=words(9, 11))
    block_tokens, _ = expected_tokens(reference, prompt, protocol)
    causal_tokens, _ = reference.greedy([], prompt.final, STEPS)
    assert block_tokens != causal_tokens


def test_pdep_task_never_hits_after_different_documents(llm, protocol):
    shared, task = DOCS[0], words(2 * BLOCK_SIZE, 6)  # task spans full blocks: hittable
    first = build(protocol, docs=[DOCS[1], shared], task=task)
    second = build(protocol, docs=[DOCS[2], shared], task=task)
    for prompt in (first, second):
        prefill(llm, prompt)
        [out] = generate(llm, [prompt.vllm_final()])
        # Everything before PDep hits; the task's full blocks never do.
        assert out.num_cached_tokens == prompt.expected_cached_tokens
        assert out.num_cached_tokens == len(prompt.final) - len(task) - 1
    [again] = generate(llm, [first.vllm_final()])  # the identical prompt does hit its task
    assert again.num_cached_tokens > first.expected_cached_tokens


def test_cache_salt_isolates_spans(llm, protocol):
    from vllm.inputs import TokensPrompt

    prompt = build(protocol, docs=[words(33, 7), words(64, 8)], system=words(10, 9))
    salted = lambda tokens, salt: TokensPrompt(prompt_token_ids=tokens, cache_salt=salt)
    # Spans prefilled alone (at block 0) under tenant a's salt ...
    generate(llm, [salted(p, "tenant-a") for p in prompt.span_prefills], steps=1)
    # ... are invisible to tenant b, and hit for tenant a at their new offsets.
    [other] = generate(llm, [salted(prompt.final, "tenant-b")])
    assert other.num_cached_tokens == 0
    [own] = generate(llm, [salted(prompt.final, "tenant-a")])
    assert own.num_cached_tokens == prompt.expected_cached_tokens


def test_same_span_twice_and_at_two_offsets_concurrently(llm, protocol, reference):
    doc = words(50, 10)
    twice = build(protocol, docs=[doc, DOCS[0], doc])
    front = build(protocol, docs=[doc, DOCS[1]], task=words(5, 12))
    back = build(protocol, docs=[DOCS[2], DOCS[1], doc], task=words(5, 12))
    for prompt in (twice, front, back):
        prefill(llm, prompt)
    outs = generate(llm, [p.vllm_final() for p in (twice, front, back)])  # one batch
    for prompt, out in zip((twice, front, back), outs):
        assert out.num_cached_tokens == prompt.expected_cached_tokens
        tokens, _ = expected_tokens(reference, prompt, protocol)
        assert list(out.outputs[0].token_ids) == tokens


def test_span_computed_in_a_final_prompt_is_cached_honestly(llm, protocol, reference):
    """Spans never prefilled alone: the final prompt computes them under their
    segment mask (Block-Attention, same as the reference), and the blocks it
    caches under SSep hashes then serve another order correctly."""
    from vllm.inputs import TokensPrompt

    docs = [words(45, 20), words(30, 21), words(60, 22)]
    first = build(protocol, docs=docs, task=words(7, 23))
    second = build(protocol, docs=docs[::-1], task=words(7, 24))
    salt = "fresh-tenant"  # nothing cached under this salt yet
    for prompt, hits_spans in ((first, False), (second, True)):
        [out] = generate(llm, [TokensPrompt(prompt_token_ids=prompt.final, cache_salt=salt)])
        assert (out.num_cached_tokens == prompt.expected_cached_tokens) == hits_spans
        tokens, logprobs = expected_tokens(reference, prompt, protocol)
        assert_same_output(out, tokens, logprobs)


def test_a_marker_inside_a_block_is_a_request_error(llm, protocol):
    """The hasher reads markers at block starts only: one elsewhere is refused, with the
    position, before the engine sees the request; the engine goes on serving."""
    from minipic.protocol import MisplacedMarkerError

    misplaced = words(5, 9) + [protocol.ssep_token_id] + words(40, 10)
    with pytest.raises(MisplacedMarkerError, match="prompt token 5 is minipic's SSep"):
        generate(llm, [{"prompt_token_ids": misplaced}], steps=1)
    aligned = words(BLOCK_SIZE, 9) + [protocol.ssep_token_id] + words(40, 10)
    assert generate(llm, [{"prompt_token_ids": aligned}], steps=1)[0].outputs[0].token_ids


def test_every_recipe_gets_the_hits_it_expects(llm, protocol):
    """expected_cached_tokens of each recipe against the engine itself (the client-side
    tests compute hits with minipic's own calculator)."""
    from minipic.client import PromptCache, Text, epic

    docs = [words(45, 31), words(80, 32)]  # not used by the other tests: no earlier hits
    task = words(9, 33)
    cache = PromptCache({"a": docs[0], "b": docs[1]}, protocol=protocol, block_size=BLOCK_SIZE)
    prompts = {
        "block_attention": build(protocol, docs=docs, system=words(20, 34), task=task),
        # EPIC recomputes each document's first block in its link, after all spans.
        "epic": epic(docs, task, protocol=protocol, block_size=BLOCK_SIZE,
                     system=words(20, 35)),
        "prompt_cache": cache.prompt("b", Text(words(5, 36)), "a", Text(task)),
    }
    for name, prompt in prompts.items():
        prefill(llm, prompt)
        [out] = generate(llm, [prompt.vllm_final()], steps=1)
        assert prompt.expected_cached_tokens > 0, name
        assert out.num_cached_tokens == prompt.expected_cached_tokens, name


# --- EPIC link blocks -----------------------------------------------------------

EPIC_DOCS = [words(70, 41), words(40, 42), words(100, 43)]  # 3, 2 and 4 blocks as spans


def epic_prompt(protocol, docs=EPIC_DOCS, task=words(9, 44), recompute_blocks=1):
    from minipic.client import epic

    return epic(docs, task, protocol=protocol, block_size=BLOCK_SIZE,
                recompute_blocks=recompute_blocks, system=words(20, 45))


def epic_reference(reference, prompt, num_docs, link_positions=True, links_take_room=False):
    """The reference's greedy tokens for an EPIC prompt. What a broken layout would do:
    `link_positions=False` puts the links at their physical positions instead,
    `links_take_room=True` pushes the task past the links (its physical position)."""
    header = len(prompt.span_prefills[0])
    spans = [len(s) for s in prompt.span_prefills[1:1 + num_docs]]
    links = [min(len(s), BLOCK_SIZE) for s in prompt.span_prefills[1:1 + num_docs]]
    task = len(prompt.final) - header - sum(spans) - sum(links)
    allowed, positions = epic_mask_and_positions(header, spans, links, task)
    if not link_positions:
        positions = torch.arange(len(prompt.final))
    if links_take_room:
        positions[len(prompt.final) - task:] += sum(links)
    return reference.greedy_masked(prompt.final, allowed, positions, STEPS)


def test_epic_hits_every_document_tail_and_matches_the_reference(llm, protocol, reference):
    prompt = epic_prompt(protocol)
    prefill(llm, prompt)
    [out] = generate(llm, [prompt.vllm_final()])
    # Header and all spans are one hit: only the three link blocks and the task are computed.
    links = len(prompt.final) - prompt.final.index(protocol.link_token_id)
    assert out.num_cached_tokens == prompt.expected_cached_tokens
    assert prompt.expected_cached_tokens == len(prompt.final) - links
    assert prompt.final.count(protocol.link_token_id) == len(EPIC_DOCS)
    tokens, logprobs = epic_reference(reference, prompt, len(EPIC_DOCS))
    assert_same_output(out, tokens, logprobs)


def test_epic_reference_depends_on_link_positions_and_links(reference, protocol):
    """Guards the reference: links at their physical positions, the task pushed past
    the links, or no links at all (Block-Attention), give other logprobs than EPIC."""
    prompt = epic_prompt(protocol)
    _, right = epic_reference(reference, prompt, len(EPIC_DOCS))
    _, physical = epic_reference(reference, prompt, len(EPIC_DOCS), link_positions=False)
    _, pushed = epic_reference(reference, prompt, len(EPIC_DOCS), links_take_room=True)
    block = build(protocol, docs=EPIC_DOCS, system=words(20, 45), task=words(9, 44))
    _, without_links = expected_tokens(reference, block, protocol)
    for other in (physical, pushed, without_links):
        assert max(abs(a - b) for a, b in zip(right, other)) > 10 * LOGPROB_ATOL


def test_epic_miss_path_computes_spans_honestly(llm, protocol, reference):
    """Nothing prefilled (a fresh salt): the final prompt computes spans and links,
    matching the reference; the spans it cached then serve another order."""
    from vllm.inputs import TokensPrompt

    docs = [words(50, 46), words(35, 47)]
    salt = "epic-fresh-tenant"
    for order, hits in (((0, 1), False), ((1, 0), True)):
        prompt = epic_prompt(protocol, docs=[docs[i] for i in order], task=words(7, 48))
        [out] = generate(llm, [TokensPrompt(prompt_token_ids=prompt.final, cache_salt=salt)])
        assert (out.num_cached_tokens == prompt.expected_cached_tokens) == hits
        tokens, logprobs = epic_reference(reference, prompt, len(docs))
        assert_same_output(out, tokens, logprobs)


def test_a_link_without_its_span_is_a_request_error(llm, protocol):
    from minipic.protocol import MisplacedMarkerError

    link_first = [protocol.link_token_id] + words(BLOCK_SIZE - 1, 49)
    span = [protocol.ssep_token_id] + words(BLOCK_SIZE - 1, 50)
    with pytest.raises(MisplacedMarkerError, match="prompt token 0 starts link block 1"):
        generate(llm, [{"prompt_token_ids": link_first + span}], steps=1)
    task = [protocol.pdep_token_id] + words(3, 51)
    assert generate(llm, [{"prompt_token_ids": span + link_first + task}], steps=1)
