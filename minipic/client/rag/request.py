"""One RAG request as the schedulers see it, and what became of it."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, AsyncIterator

from minipic.client.backends.base import Completion
from minipic.client.span_prefill import SpanPrefill
from minipic.client.prompts.span_prompt import SpanPrompt

_numbers = itertools.count()


@dataclasses.dataclass(frozen=True)
class RagRequest:
    """A span prompt (span prefills + final prompt) and how to answer it."""

    prompt: SpanPrompt
    max_tokens: int = 64
    temperature: float = 0.0
    request_id: str = dataclasses.field(default_factory=lambda: f"rag-{next(_numbers)}")
    metadata: Any = None  # the caller's own (e.g. the question), carried to the result


class SpanPrefillFailed(RuntimeError):
    """A span this request needs could not be prefilled; its final prompt was not sent."""

    @classmethod
    def of(cls, failures: list[BaseException], num_spans: int) -> "SpanPrefillFailed":
        error = cls(f"{len(failures)} of {num_spans} span prefills failed, "
                    f"first: {failures[0]!r}")
        error.__cause__ = failures[0]
        return error


@dataclasses.dataclass(frozen=True)
class RagResult:
    request: RagRequest
    completion: Completion | None  # None when the request failed
    error: BaseException | None
    spans: tuple[SpanPrefill, ...]  # the prefills it waited on (may be shared with others)
    arrived_at: float  # time.monotonic() when the scheduler took the request

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def text(self) -> str:
        if self.completion is None:
            raise RuntimeError(f"request {self.request.request_id} failed") from self.error
        return self.completion.text

    @property
    def cached_tokens(self) -> int | None:
        return None if self.completion is None else self.completion.cached_tokens

    @property
    def expected_cached_tokens(self) -> int:
        return self.request.prompt.expected_cached_tokens

    @property
    def latency(self) -> float | None:
        """Arrival to answer, span prefills included."""
        return None if self.completion is None else self.completion.finished_at - self.arrived_at


async def iterate_requests(requests: Any) -> AsyncIterator[RagRequest]:
    """A list, an iterator or an async iterator of RagRequest (or bare SpanPrompt)."""
    if hasattr(requests, "__aiter__"):
        async for request in requests:
            yield _as_request(request)
    else:
        for request in requests:
            yield _as_request(request)


def _as_request(item: Any) -> RagRequest:
    if isinstance(item, RagRequest):
        return item
    if isinstance(item, SpanPrompt):
        return RagRequest(item)
    raise TypeError(f"expected a RagRequest or SpanPrompt, got {type(item).__name__}")
