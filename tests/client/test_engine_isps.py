"""ISPS and the barrier strategy on a real in-process AsyncLLM (CPU, tiny model, minipic on).

Ordering is observed the way a user would: a final prompt that ran before
its spans were prefilled would report fewer cached tokens than the layout
promises. Every test uses documents the engine has never seen, so a hit can
only come from the scheduler's own span prefills.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from conftest import BLOCK_SIZE, MINIPIC_ON, engine_kwargs

from minipic.client.backends import AsyncLLMBackend
from minipic.client.rag.barrier import BatchedScheduler
from minipic.client.rag.isps import InterleavedScheduler
from minipic.client.rag.request import RagRequest, SpanPrefillFailed
from minipic.client.prompts.recipes import block_attention

pytestmark = pytest.mark.engine
MAX_MODEL_LEN = 1024
FIRST_WORD_ID = 7  # ids below are <unk>, <s>, </s> and the reserved markers


@pytest.fixture(scope="module")
def loop():
    # AsyncLLM binds its output handler to the loop that first uses it: one loop per module.
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def backend(tiny_model, loop):
    async def start():
        return AsyncLLMBackend.start(**engine_kwargs(tiny_model, max_model_len=MAX_MODEL_LEN,
                                                     **MINIPIC_ON))

    backend = loop.run_until_complete(start())
    yield backend
    loop.run_until_complete(backend.close())


@pytest.fixture(scope="module")
def protocol(backend):
    return backend.span_protocol()


def words(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(FIRST_WORD_ID, 400) for _ in range(n)]


def workload(protocol, seed: int, shape=((0, 1, 2), (2, 3), (4, 0, 1), (3,), (1, 4, 2, 0))):
    """RAG requests over 5 fresh documents (1-3 blocks each), shared between requests."""
    docs = [words(20 + 25 * (i % 3), seed * 100 + i) for i in range(5)]
    system = words(40, seed * 100 + 50)
    return [RagRequest(block_attention([docs[i] for i in ids], words(7, seed * 100 + 60 + n),
                                       system=system, protocol=protocol, block_size=BLOCK_SIZE),
                       max_tokens=2)
            for n, ids in enumerate(shape)]


def run(loop, scheduler, requests, timeout_s=240):
    return loop.run_until_complete(asyncio.wait_for(scheduler.run(requests), timeout_s))


def assert_all_hit(results):
    for r in results:
        assert r.ok, r.error
        assert r.cached_tokens == r.expected_cached_tokens > 0, r.request.request_id


@pytest.mark.parametrize("cap", [2, 16])
def test_isps_final_prompts_hit_every_span(loop, backend, protocol, cap):
    requests = workload(protocol, seed=cap)
    results = run(loop, InterleavedScheduler(backend, protocol, max_in_flight=cap), requests)
    assert_all_hit(results)
    # The spans really were new: the hits came from this run's prefills.
    first_seen = {s.key: s for r in results for s in r.spans}
    assert not any(s.already_stored for s in first_seen.values())


def test_batched_final_prompts_hit_every_span(loop, backend, protocol):
    requests = workload(protocol, seed=3)
    results = run(loop, BatchedScheduler(backend, protocol, batch_size=2, max_in_flight=4),
                  requests)
    assert_all_hit(results)


def test_no_deadlock_with_one_slot_for_many_spans(loop, backend, protocol):
    [request] = workload(protocol, seed=4, shape=[(0, 1, 2, 3, 4)])
    assert len(request.prompt.span_prefills) == 6  # header + 5 documents
    [result] = run(loop, InterleavedScheduler(backend, protocol, max_in_flight=1), [request],
                   timeout_s=120)
    assert_all_hit([result])


def test_failing_requests_do_not_stall_the_rest(loop, backend, protocol):
    good = workload(protocol, seed=5)
    too_long_span = RagRequest(block_attention([words(MAX_MODEL_LEN + 50, 501)], words(5, 502),
                                               protocol=protocol, block_size=BLOCK_SIZE))
    # Each span fits, the final prompt does not.
    too_long_final = RagRequest(block_attention([words(400, 503 + i) for i in range(3)],
                                                words(5, 506), protocol=protocol,
                                                block_size=BLOCK_SIZE))
    requests = [good[0], too_long_span, good[1], too_long_final, *good[2:]]
    results = run(loop, InterleavedScheduler(backend, protocol, max_in_flight=2), requests)
    assert [r.ok for r in results] == [True, False, True, False, True, True, True]
    assert isinstance(results[1].error, SpanPrefillFailed)
    assert "max" in str(results[1].error).lower() or "long" in str(results[1].error).lower()
    assert results[3].spans and all(s.cached_tokens is not None for s in results[3].spans)
    assert not isinstance(results[3].error, SpanPrefillFailed)
    assert_all_hit([r for r in results if r.ok])
