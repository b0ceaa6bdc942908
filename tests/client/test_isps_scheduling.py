"""ISPS and the barrier strategy against a fake engine: ordering, caps, sharing, failures."""

from __future__ import annotations

import asyncio
import random

import pytest
from fake_backend import BLOCK, PROTOCOL, FakeBackend

from minipic.client.rag.barrier import BatchedScheduler
from minipic.client.rag.isps import InterleavedScheduler
from minipic.client.rag.request import RagRequest, SpanPrefillFailed
from minipic.client.prompts.recipes import block_attention
from minipic.client.span_prefill import probe_prompt

POISON = 999  # a word the fake engine refuses


def words(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


DOCS = [words(3 + 2 * i, i) for i in range(6)]  # 1 to 4 blocks once wrapped
SYSTEM = words(5, 100)


def request(doc_ids, task_seed=0, docs=DOCS) -> RagRequest:
    prompt = block_attention([docs[i] for i in doc_ids], words(3, 200 + task_seed),
                             system=SYSTEM, protocol=PROTOCOL, block_size=BLOCK)
    return RagRequest(prompt, max_tokens=4)


WORKLOAD = [request(ids, n) for n, ids in enumerate(
    [(0, 1, 2), (2, 3), (4, 0, 5, 1), (5,), (3, 4, 2, 1, 0), (1, 2)])]


def isps(backend, cap):
    return InterleavedScheduler(backend, PROTOCOL, max_in_flight=cap)


def batched(backend, cap):
    return BatchedScheduler(backend, PROTOCOL, batch_size=4, max_in_flight=cap)


STRATEGIES = [pytest.param(isps, id="isps"), pytest.param(batched, id="batched")]


def run(scheduler, requests, timeout_s=10.0):
    return asyncio.run(asyncio.wait_for(scheduler.run(requests), timeout_s))


def position(backend, kind, prompt) -> int:
    return backend.events.index((kind, tuple(prompt)))


@pytest.mark.parametrize("cap", [1, 2, 16])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_final_prompt_never_starts_before_its_spans(strategy, cap):
    backend = FakeBackend()
    results = run(strategy(backend, cap), WORKLOAD)
    assert [r.request for r in results] == WORKLOAD  # request order
    for r in results:
        assert r.ok, r.error
        final_start = position(backend, "start", r.request.prompt.final)
        for span in r.request.prompt.span_prefills:
            assert position(backend, "end", probe_prompt(span, PROTOCOL)) < final_start
        # What an engine would show: every span block before the task hits.
        assert r.cached_tokens == r.expected_cached_tokens > 0
    assert backend.max_in_flight <= cap


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_deadlock_with_fewer_slots_than_spans(strategy):
    backend = FakeBackend()
    big = request(range(6))
    assert len(big.prompt.span_prefills) == 7  # header + 6 documents, one slot
    [result] = run(strategy(backend, 1), [big])
    assert result.ok and result.cached_tokens == result.expected_cached_tokens
    assert backend.max_in_flight == 1


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_shared_spans_are_prefilled_once(strategy):
    backend = FakeBackend()
    run(strategy(backend, 3), WORKLOAD)
    probes = [tuple(probe_prompt(s, PROTOCOL)) for r in WORKLOAD for s in r.prompt.span_prefills]
    starts = [p for kind, p in backend.events if kind == "start" and p in set(probes)]
    assert sorted(starts) == sorted(set(probes))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_failing_span_fails_only_the_requests_that_need_it(strategy):
    docs = DOCS + [[POISON, 11, 12]]
    requests = [request((0, 6), 0, docs), request((1, 2), 1, docs),
                request((6,), 2, docs), request((3,), 3, docs)]
    backend = FakeBackend(fail_if=lambda prompt: POISON in prompt)
    results = run(strategy(backend, 2), requests)
    assert [r.ok for r in results] == [False, True, False, True]
    for r in results:
        if not r.ok:
            assert isinstance(r.error, SpanPrefillFailed)
            assert ("start", tuple(r.request.prompt.final)) not in backend.events
        else:
            assert r.cached_tokens == r.expected_cached_tokens


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_failing_final_prompt_fails_only_its_request(strategy):
    bad = WORKLOAD[2].prompt.final
    backend = FakeBackend(fail_if=lambda prompt: prompt == bad)
    results = run(strategy(backend, 2), WORKLOAD)
    assert [r.ok for r in results] == [i != 2 for i in range(len(WORKLOAD))]
    assert isinstance(results[2].error, ValueError)


def test_isps_runs_ready_final_prompts_before_queued_spans():
    backend = FakeBackend()
    a, b = request((0, 1), 0), request((2, 3), 1)
    run(isps(backend, 1), [a, b])
    started = [p for kind, p in backend.events if kind == "start"]
    # a's header and two spans, then a's final ahead of b's queued spans, then b.
    assert started.index(tuple(a.prompt.final)) == len(a.prompt.span_prefills)
    assert started[-1] == tuple(b.prompt.final)


def test_batched_waits_for_every_span_of_the_batch():
    backend = FakeBackend()
    run(batched(backend, 16), WORKLOAD[:4])  # one batch
    finals = {tuple(r.prompt.final) for r in WORKLOAD[:4]}
    first_final = min(i for i, (k, p) in enumerate(backend.events) if k == "start" and p in finals)
    last_span_end = max(i for i, (k, p) in enumerate(backend.events)
                        if k == "end" and p not in finals)
    assert last_span_end < first_final


def test_isps_answers_while_requests_are_still_arriving():
    backend = FakeBackend(delay_s=0.005)
    arrivals = []

    async def arriving():
        for r in WORKLOAD[:3]:
            arrivals.append(asyncio.get_running_loop().time())
            yield r
            await asyncio.sleep(0.3)

    async def main():
        firsts = []
        async for result in isps(backend, 4).stream(arriving()):
            firsts.append((result.request, asyncio.get_running_loop().time()))
        return firsts

    answered = asyncio.run(main())
    assert [r for r, _ in answered] == WORKLOAD[:3]
    assert answered[0][1] < arrivals[1]  # no barrier: the first answer beats the second arrival


def test_isps_sends_a_span_before_it_has_read_a_long_list():
    """Requests given as one list (as a batch job gives them) are read while the slots
    send: the first span prefill leaves before the last request is read, so the engine
    is not idle while the client reads thousands of requests."""
    read = 0

    def reading():
        nonlocal read
        for n in range(200):
            read += 1
            yield request([n % len(DOCS), (n + 1) % len(DOCS)], n)

    class Recording(FakeBackend):
        read_at_first_call = None

        async def complete(self, prompt, **kwargs):
            if self.read_at_first_call is None:
                self.read_at_first_call = read
            return await super().complete(prompt, **kwargs)

    backend = Recording(delay_s=0.001)
    results = run(isps(backend, 8), reading())
    assert len(results) == 200 and all(r.ok for r in results)
    assert backend.read_at_first_call < 200


def test_a_failing_input_stream_ends_the_run():
    async def broken():
        yield WORKLOAD[0]
        raise OSError("lost the queue")

    with pytest.raises(OSError, match="lost the queue"):
        run(isps(FakeBackend(), 2), broken())


def fail_first_prefill_of_doc_0():
    failures = {"left": 1}

    def fail_once(prompt):
        if prompt[:len(DOCS[0]) + 1] != [PROTOCOL.ssep_token_id] + DOCS[0] or not failures["left"]:
            return False
        failures["left"] -= 1
        return True

    return fail_once


def test_batched_retries_a_span_whose_prefill_failed_in_an_earlier_batch():
    backend = FakeBackend(delay_s=0.001, fail_if=fail_first_prefill_of_doc_0())
    scheduler = BatchedScheduler(backend, PROTOCOL, batch_size=1)
    first, second, third = run(scheduler, [request((0,), n) for n in range(3)])
    assert not first.ok and isinstance(first.error, SpanPrefillFailed)
    assert second.ok and third.ok and third.cached_tokens == third.expected_cached_tokens


def test_isps_retries_a_span_whose_prefill_failed_earlier():
    """A transient failure fails the requests that waited for it, not every later one."""
    backend = FakeBackend(delay_s=0.005, fail_if=fail_first_prefill_of_doc_0())

    async def arriving():
        yield request((0,), 0)
        await asyncio.sleep(0.2)  # the first prefill of DOCS[0] has failed by now
        yield request((0,), 1)

    async def main():
        return [r async for r in isps(backend, 2).stream(arriving())]

    first, second = asyncio.run(main())
    assert not first.ok and isinstance(first.error, SpanPrefillFailed)
    assert second.ok and second.cached_tokens == second.expected_cached_tokens
