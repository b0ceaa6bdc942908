"""The interface every backend implements, and what a completion reports."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence

from minipic.protocol import SpanProtocol


@dataclasses.dataclass(frozen=True)
class Completion:
    text: str
    prompt_tokens: int
    # Prompt tokens the engine served from cache (vLLM's num_cached_tokens);
    # None when the backend cannot tell (a server without
    # --enable-prompt-tokens-details).
    cached_tokens: int | None
    started_at: float  # time.monotonic() at submission
    finished_at: float

    @property
    def seconds(self) -> float:
        return self.finished_at - self.started_at


class CompletionBackend(Protocol):
    model: str
    # The engine's KV block size when the backend can know it (in-process);
    # None for a server, which does not publish it.
    block_size: int | None
    # The longest prompt + output the engine takes (None: unknown). Optional.
    max_model_len: int | None

    def get_tokenizer(self) -> Any: ...

    def span_protocol(self) -> SpanProtocol:
        """The marker ids the engine hashes with."""

    async def complete(self, prompt: Sequence[int], *, max_tokens: int,
                       temperature: float = 0.0) -> Completion: ...

    async def close(self) -> None: ...
