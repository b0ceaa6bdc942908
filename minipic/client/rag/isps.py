"""ISPS: PIC-aware interleaved scheduling of span prefills and final prompts (paper 3.4).

Requests arrive as a stream. Span prefills and final prompts share one pool
of `max_in_flight` engine slots (the paper's max_num_seqs knob), with no
barrier between them:

  * when a request arrives, its span prefills are queued; a span that several
    requests share is prefilled once;
  * its final prompt is queued the moment its last span is done, never
    before (it would miss and recompute the spans);
  * queued final prompts go before queued span prefills: they finish
    requests, and they use spans while those are still cached.

A final prompt waiting for its spans holds no slot, so any cap of 1 or more
makes progress: no deadlock, even with more spans in a request than slots.
A span that fails fails only the requests that need it; a final prompt that
fails, only its own request. Failures are results, never exceptions.

    scheduler = InterleavedScheduler(backend, protocol, max_in_flight=64)
    results = await scheduler.run(requests)          # in request order
    async for result in scheduler.stream(requests):  # as they finish
        ...
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from typing import Any, AsyncIterator, Awaitable, Callable

from minipic.client.backends.base import CompletionBackend
from minipic.client.rag.request import (
    RagRequest, RagResult, SpanPrefillFailed, iterate_requests,
)
from minipic.client.span_prefill import SpanPrefill, prefill_span
from minipic.protocol import SpanProtocol

# Queue priorities: lower runs first.
FINAL_PROMPT, SPAN_PREFILL = 0, 1


class InterleavedScheduler:
    def __init__(self, backend: CompletionBackend, protocol: SpanProtocol, *,
                 max_in_flight: int = 64):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.backend = backend
        self.protocol = protocol
        self.max_in_flight = max_in_flight

    async def run(self, requests: Any) -> list[RagResult]:
        """All results, in the order the requests came."""
        numbered = [pair async for pair in self._numbered_stream(requests)]
        return [result for _, result in sorted(numbered, key=lambda pair: pair[0])]

    async def stream(self, requests: Any) -> AsyncIterator[RagResult]:
        """Results as requests finish; `requests` may be an async iterator (online arrival)."""
        async for _, result in self._numbered_stream(requests):
            yield result

    async def _numbered_stream(self, requests: Any) -> AsyncIterator[tuple[int, RagResult]]:
        run = _Run(self.backend, self.protocol)
        tasks = [asyncio.ensure_future(run.serve_slot()) for _ in range(self.max_in_flight)]
        tasks.append(asyncio.ensure_future(run.admit(requests)))
        try:
            async for numbered in run.results():
                yield numbered
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


@dataclasses.dataclass(eq=False)
class _Span:
    tokens: tuple[int, ...]  # also the run's name for the span (its key in _Run.spans)
    outcome: SpanPrefill | BaseException | None = None  # None: not done yet
    waiting: list["_Waiting"] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class _Waiting:
    """A request whose final prompt waits for `pending` more spans."""

    index: int
    request: RagRequest
    spans: list[_Span]
    arrived_at: float
    pending: int = 0


class _Run:
    """The state of one `stream()` call.

    Span completions release final prompts synchronously (no task hop), so a
    final prompt is queued before the slot that finished its last span picks
    its next job: the priority order holds exactly.
    """

    def __init__(self, backend: CompletionBackend, protocol: SpanProtocol):
        self.backend = backend
        self.protocol = protocol
        self.jobs: asyncio.PriorityQueue = asyncio.PriorityQueue()
        self.order = itertools.count()  # FIFO within a priority
        self.spans: dict[tuple[int, ...], _Span] = {}
        self.finished: asyncio.Queue = asyncio.Queue()

    def submit(self, priority: int, job: Callable[[], Awaitable[None]]) -> None:
        self.jobs.put_nowait((priority, next(self.order), job))

    async def serve_slot(self) -> None:
        """One engine slot: run queued jobs one after another, until cancelled."""
        while True:
            _, _, job = await self.jobs.get()
            await job()  # jobs record their own failures

    async def admit(self, requests: Any) -> None:
        count = 0
        try:
            async for request in iterate_requests(requests):
                self.admit_one(count, request)
                count += 1
                # Let the slots send what is queued: reading a long list in one go kept
                # every request from the engine until the last was read (0.4 s for
                # 2000 RAG requests, the engine idle).
                await asyncio.sleep(0)
        except Exception as e:
            self.finished.put_nowait(e)  # the input itself failed: end the run with it
        else:
            self.finished.put_nowait(_Admitted(count))

    def admit_one(self, index: int, request: RagRequest) -> None:
        spans = [self.span(tokens) for tokens in request.prompt.span_prefills]
        waiting = _Waiting(index, request, spans, time.monotonic())
        for span in spans:
            if span.outcome is None:
                span.waiting.append(waiting)
                waiting.pending += 1
        if waiting.pending == 0:
            self.release(waiting)

    def span(self, tokens: list[int]) -> _Span:
        # The tokens themselves are the key: hashing them (span_key) cost 20 us a document
        # slot, and every slot of every request comes here.
        key = tuple(tokens)
        span = self.spans.get(key)
        if span is None:
            span = self.spans[key] = _Span(key)
            self.submit(SPAN_PREFILL, lambda: self.prefill(span))
        return span

    async def prefill(self, span: _Span) -> None:
        try:
            span.outcome = await prefill_span(self.backend, span.tokens, self.protocol)
        except Exception as e:
            span.outcome = e
        for waiting in span.waiting:
            waiting.pending -= 1
            if waiting.pending == 0:
                self.release(waiting)
        span.waiting.clear()
        if isinstance(span.outcome, BaseException):
            # Fail only the requests that waited; a later request retries the span.
            self.spans.pop(span.tokens, None)

    def release(self, waiting: _Waiting) -> None:
        """All spans are done: queue the final prompt, or fail the request."""
        failures = [s.outcome for s in waiting.spans if isinstance(s.outcome, BaseException)]
        if failures:
            self.finish(waiting, None, SpanPrefillFailed.of(failures, len(waiting.spans)))
        else:
            self.submit(FINAL_PROMPT, lambda: self.answer(waiting))

    async def answer(self, waiting: _Waiting) -> None:
        request = waiting.request
        try:
            completion = await self.backend.complete(
                request.prompt.final, max_tokens=request.max_tokens,
                temperature=request.temperature)
        except Exception as e:
            self.finish(waiting, None, e)
        else:
            self.finish(waiting, completion, None)

    def finish(self, waiting: _Waiting, completion: Any, error: BaseException | None) -> None:
        prefills = tuple(s.outcome for s in waiting.spans if isinstance(s.outcome, SpanPrefill))
        result = RagResult(waiting.request, completion, error, prefills, waiting.arrived_at)
        self.finished.put_nowait((waiting.index, result))

    async def results(self) -> AsyncIterator[tuple[int, RagResult]]:
        expected, seen = None, 0
        while expected is None or seen < expected:
            item = await self.finished.get()
            if isinstance(item, _Admitted):
                expected = item.count
            elif isinstance(item, Exception):
                raise item
            else:
                seen += 1
                yield item


@dataclasses.dataclass(frozen=True)
class _Admitted:
    """The input is exhausted after `count` requests."""

    count: int
