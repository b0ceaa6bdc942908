"""A CompletionBackend without an engine, with the engine's cache-hit rules.

A prompt's cached tokens are computed when it starts, from the prompts that
finished before (vLLM's rules, via minipic's own hit calculator): a final
prompt started before its spans finished shows it by missing them.
"""

from __future__ import annotations

import asyncio
import time

from minipic.client.backends.base import Completion
from minipic.client.prompts.expected_hits import expected_cached_tokens
from minipic.protocol import SpanProtocol

PROTOCOL = SpanProtocol(3, 4, 5, link_token_id=6)
BLOCK = 4


class FakeBackend:
    model = "fake-model"
    block_size = BLOCK

    def __init__(self, *, delay_s: float = 0.01, fail_if=lambda prompt: False, tokenizer=None):
        self.tokenizer = tokenizer
        self.delay_s = delay_s
        self.fail_if = fail_if
        self.done: list[list[int]] = []  # prompts in the order they finished
        self.events: list[tuple[str, tuple[int, ...]]] = []  # ("start"|"end", prompt)
        self.in_flight = self.max_in_flight = 0

    def get_tokenizer(self):
        return self.tokenizer

    def span_protocol(self) -> SpanProtocol:
        return PROTOCOL

    async def complete(self, prompt, *, max_tokens, temperature=0.0) -> Completion:
        prompt = list(prompt)
        started = time.monotonic()
        cached = expected_cached_tokens(prompt, self.done, PROTOCOL, BLOCK)
        self.events.append(("start", tuple(prompt)))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
            if self.fail_if(prompt):
                raise ValueError("refused by the fake engine")
        finally:
            self.in_flight -= 1
            self.events.append(("end", tuple(prompt)))
        self.done.append(prompt)
        return Completion(f"answer-{len(prompt)}", len(prompt), cached, started,
                          time.monotonic())

    async def close(self) -> None:
        pass
