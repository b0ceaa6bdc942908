"""The barrier ("batched") strategy, the paper's baseline for ISPS (section 4).

Requests are taken `batch_size` at a time. For each batch: prefill every span
it needs that this run has not prefilled yet, wait for all of them (the
barrier), then send its final prompts and wait for those. The engine idles at
each barrier while the slowest request of the phase finishes; that idle time
is what ISPS removes. Same inputs, results and failure rules as
`InterleavedScheduler`, so the two can be compared on one workload.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Awaitable, Iterable, TypeVar

from minipic.client.backends.base import CompletionBackend
from minipic.client.prompts.document_spans import span_key
from minipic.client.rag.request import (
    RagRequest, RagResult, SpanPrefillFailed, iterate_requests,
)
from minipic.client.span_prefill import SpanPrefill, prefill_span
from minipic.protocol import SpanProtocol

T = TypeVar("T")


async def gather_bounded(coros: Iterable[Awaitable[T]], limit: int) -> list[T | BaseException]:
    """Like gather(return_exceptions=True), with at most `limit` running at once."""
    slots = asyncio.Semaphore(limit)

    async def bounded(coro: Awaitable[T]) -> T:
        async with slots:
            return await coro

    return await asyncio.gather(*(bounded(c) for c in coros), return_exceptions=True)


class BatchedScheduler:
    def __init__(self, backend: CompletionBackend, protocol: SpanProtocol, *,
                 batch_size: int = 64, max_in_flight: int = 1024):
        if batch_size < 1 or max_in_flight < 1:
            raise ValueError("batch_size and max_in_flight must be >= 1")
        self.backend = backend
        self.protocol = protocol
        self.batch_size = batch_size
        self.max_in_flight = max_in_flight

    async def run(self, requests: Any) -> list[RagResult]:
        """All results, in the order the requests came."""
        return [result async for result in self.stream(requests)]

    async def stream(self, requests: Any) -> AsyncIterator[RagResult]:
        """Results batch by batch, each batch in request order."""
        prefilled: dict[str, SpanPrefill | BaseException] = {}  # this run's spans, by key
        async for batch in _batches(iterate_requests(requests), self.batch_size):
            arrived_at = time.monotonic()
            await self._prefill_missing(batch, prefilled)
            for result in await self._answer(batch, prefilled, arrived_at):
                yield result

    async def _prefill_missing(self, batch: list[RagRequest],
                               prefilled: dict[str, SpanPrefill | BaseException]) -> None:
        needed = {span_key(s): s for r in batch for s in r.prompt.span_prefills}
        # A span whose prefill failed in an earlier batch is tried again, as ISPS does.
        missing = {k: s for k, s in needed.items()
                   if not isinstance(prefilled.get(k), SpanPrefill)}
        outcomes = await gather_bounded(
            (prefill_span(self.backend, s, self.protocol) for s in missing.values()),
            self.max_in_flight)
        prefilled.update(zip(missing, outcomes))

    async def _answer(self, batch: list[RagRequest],
                      prefilled: dict[str, SpanPrefill | BaseException],
                      arrived_at: float) -> list[RagResult]:
        async def answer(request: RagRequest) -> RagResult:
            outcomes = [prefilled[span_key(s)] for s in request.prompt.span_prefills]
            prefills = tuple(o for o in outcomes if isinstance(o, SpanPrefill))
            failures = [o for o in outcomes if not isinstance(o, SpanPrefill)]
            if failures:
                error = SpanPrefillFailed.of(failures, len(outcomes))
                return RagResult(request, None, error, prefills, arrived_at)
            try:
                completion = await self.backend.complete(
                    request.prompt.final, max_tokens=request.max_tokens,
                    temperature=request.temperature)
            except Exception as e:
                return RagResult(request, None, e, prefills, arrived_at)
            return RagResult(request, completion, None, prefills, arrived_at)

        return await gather_bounded((answer(r) for r in batch), self.max_in_flight)


async def _batches(items: AsyncIterator[T], size: int) -> AsyncIterator[list[T]]:
    batch: list[T] = []
    async for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
