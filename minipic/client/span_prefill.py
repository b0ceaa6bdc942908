"""Prefill one span so it lands in the cache, and learn whether it was already there.

A span is sent with one extra token after it (the padding token): the
engine computes at least one token of every prompt, and with the extra token
that one is not the span's. So a span that is fully cached reports all of its
tokens cached and costs one token of compute, whatever its length (a plain
span would recompute its last block, and a one-block span could never show a
hit). The trailing token fills no block, so nothing extra is cached, and the
span's KV is the same as without it: nothing in a span attends forward.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from minipic.client.backends.base import CompletionBackend
from minipic.client.prompts.document_spans import span_key
from minipic.protocol import SpanProtocol


@dataclasses.dataclass(frozen=True)
class SpanPrefill:
    key: str
    num_tokens: int
    cached_tokens: int | None  # None: the backend does not report hits
    started_at: float
    finished_at: float

    @property
    def already_stored(self) -> bool | None:
        """Whether the whole span was cached before this prefill (None: unknown)."""
        return None if self.cached_tokens is None else self.cached_tokens >= self.num_tokens


def probe_prompt(span: Sequence[int], protocol: SpanProtocol) -> list[int]:
    return [*span, protocol.pad_token_id]


async def prefill_span(backend: CompletionBackend, span: Sequence[int],
                       protocol: SpanProtocol) -> SpanPrefill:
    completion = await backend.complete(probe_prompt(span, protocol), max_tokens=1)
    return SpanPrefill(span_key(span), len(span), completion.cached_tokens,
                       completion.started_at, completion.finished_at)

