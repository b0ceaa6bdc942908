"""In-process backends: vLLM's AsyncLLM (concurrent) and LLM (one call at a time).

In process, the tools read what a server hides: the block size, and the span
protocol from the engine's own minipic config, so prompts always carry the
markers the engine hashes with.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any, Sequence

from minipic.client.backends.base import Completion
from minipic.config import minipic_options
from minipic.protocol import SpanProtocol


def engine_span_protocol(vllm_config: Any, tokenizer: Any) -> SpanProtocol:
    """The engine's markers: explicit ids in its minipic options, else the tokenizer's.

    With minipic off the engine hashes no markers; the tokenizer's defaults
    still give prompts the same layout, so hits can be compared on and off.
    """
    options = minipic_options(vllm_config) or {}
    if any(k in options for k in ("ssep_token_id", "pdep_token_id", "pad_token_id")):
        return SpanProtocol.from_dict(options)  # as the engine does (minipic.protocol)
    return SpanProtocol.from_tokenizer(tokenizer)


def _sampling_params(max_tokens: int, temperature: float) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(max_tokens=max_tokens, temperature=temperature,
                          output_kind=RequestOutputKind.FINAL_ONLY)


def _completion(output: Any, prompt_tokens: int, started_at: float) -> Completion:
    return Completion(text=output.outputs[0].text, prompt_tokens=prompt_tokens,
                      cached_tokens=output.num_cached_tokens, started_at=started_at,
                      finished_at=time.monotonic())


class AsyncLLMBackend:
    """`vllm.v1.engine.async_llm.AsyncLLM`: requests run concurrently, batched by vLLM."""

    def __init__(self, engine: Any, *, owns_engine: bool = False):
        self.engine = engine
        self.model = engine.model_config.model
        self.block_size = engine.vllm_config.cache_config.block_size
        self.max_model_len = engine.model_config.max_model_len
        self._owns_engine = owns_engine

    @classmethod
    def start(cls, **engine_args: Any) -> "AsyncLLMBackend":
        """Start an engine from AsyncEngineArgs keywords; `close()` shuts it down."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        return cls(AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args)), owns_engine=True)

    def get_tokenizer(self) -> Any:
        return self.engine.get_tokenizer()

    def span_protocol(self) -> SpanProtocol:
        return engine_span_protocol(self.engine.vllm_config, self.get_tokenizer())

    async def complete(self, prompt: Sequence[int], *, max_tokens: int,
                       temperature: float = 0.0) -> Completion:
        from vllm.inputs import TokensPrompt

        started_at = time.monotonic()
        final = None
        # Leaving this loop early (cancellation) makes AsyncLLM abort the request.
        async for output in self.engine.generate(
                TokensPrompt(prompt_token_ids=list(prompt)),
                _sampling_params(max_tokens, temperature), f"minipic-{uuid.uuid4().hex}"):
            final = output
        return _completion(final, len(prompt), started_at)

    async def close(self) -> None:
        if self._owns_engine and self.engine is not None:
            # Drop our reference too: a stopped AsyncLLM kept alive until
            # interpreter exit fails in its __del__ (vLLM's globals are gone).
            engine, self.engine = self.engine, None
            engine.shutdown()


class LLMBackend:
    """`vllm.LLM`: not safe to call concurrently, so requests go one at a time
    (in a thread, keeping the event loop free). Use AsyncLLM or a server for ISPS."""

    def __init__(self, llm: Any):
        self.llm = llm
        vllm_config = llm.llm_engine.vllm_config
        self.model = vllm_config.model_config.model
        self.block_size = vllm_config.cache_config.block_size
        self.max_model_len = vllm_config.model_config.max_model_len
        # A thread lock, not an asyncio one: the backend may outlive an event loop
        # (one asyncio.run per call), and the lock is held in the worker thread.
        self._lock = threading.Lock()

    def get_tokenizer(self) -> Any:
        return self.llm.get_tokenizer()

    def span_protocol(self) -> SpanProtocol:
        return engine_span_protocol(self.llm.llm_engine.vllm_config, self.get_tokenizer())

    async def complete(self, prompt: Sequence[int], *, max_tokens: int,
                       temperature: float = 0.0) -> Completion:
        from vllm.inputs import TokensPrompt

        params = _sampling_params(max_tokens, temperature)
        started_at = time.monotonic()
        output = await asyncio.to_thread(self._generate_one, TokensPrompt(
            prompt_token_ids=list(prompt)), params)
        return _completion(output, len(prompt), started_at)

    def _generate_one(self, prompt: Any, params: Any) -> Any:
        with self._lock:
            [output] = self.llm.generate([prompt], params, use_tqdm=False)
        return output

    async def close(self) -> None:
        pass  # the caller made the LLM and stops it
