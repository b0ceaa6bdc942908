"""An OpenAI-compatible vLLM server, through the `openai` package's async client.

Prompts go to /v1/completions as token ids, so the server never re-tokenizes
(re-tokenizing text could move or drop the span markers). Cached tokens come
back in `usage.prompt_tokens_details.cached_tokens`, which vLLM only fills
when started with `--enable-prompt-tokens-details`; without it the tools
still work but cannot tell hits from misses.

`connect` reads the server's KV block size and span protocol from minipic's
GET /v1/minipic/settings (server_settings.py) and refuses a server without
minipic, which would store no span; a block size or protocol given here must
agree with the server's. `trust_server=True` skips the check (vLLM 0.25.1
servers have no settings route) and then needs the block size. The tokenizer is
loaded locally (transformers) from `tokenizer`, or else from the served model's name,
only when a tool needs token ids: `preload_documents` (minipic-preload) sends text to
the server's POST /v1/minipic/preload instead (server_preload.py), which a connection
with `trust_server=True` does not use (`server_settings` is None).
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Sequence

from minipic.client.backends.base import Completion
from minipic.client.backends.server_preload import PreloadedSpan, preload_documents
from minipic.client.backends.server_settings import ServerSettings
from minipic.protocol import SpanProtocol


def _api_base(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


class OpenAIServerBackend:
    def __init__(self, client: Any, model: str, *, block_size: int | None = None,
                 tokenizer: str | None = None, protocol: SpanProtocol | None = None,
                 max_model_len: int | None = None, settings: ServerSettings | None = None):
        self.client = client
        # The server's published settings; None when connected with trust_server=True.
        self.server_settings = settings
        self.model = model
        self.block_size = block_size
        self.max_model_len = max_model_len
        self._tokenizer_name = tokenizer or model
        self._tokenizer: Any = None
        self._protocol = protocol

    @classmethod
    async def connect(cls, url: str, *, model: str | None = None, api_key: str | None = None,
                      block_size: int | None = None, tokenizer: str | None = None,
                      protocol: SpanProtocol | None = None, trust_server: bool = False,
                      timeout_s: float = 600.0) -> "OpenAIServerBackend":
        """`model` defaults to the server's first (usually only) served model."""
        import openai

        from minipic.client.backends.server_settings import fetch_server_settings

        settings = None
        if not trust_server:
            settings = await fetch_server_settings(url, api_key)
            settings.check_overrides(block_size, protocol)
            block_size, protocol = settings.block_size, settings.protocol

        client = openai.AsyncOpenAI(base_url=_api_base(url), api_key=api_key or "EMPTY",
                                    timeout=timeout_s)
        models = (await client.models.list()).data
        if model is None:
            if not models:
                raise RuntimeError(f"the server at {url} serves no model")
            model = models[0].id
        # vLLM's model cards carry max_model_len (an extra field to the OpenAI client).
        card = next((m for m in models if m.id == model), None)
        return cls(client, model, block_size=block_size, tokenizer=tokenizer, protocol=protocol,
                   max_model_len=getattr(card, "max_model_len", None), settings=settings)

    def get_tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_name)
        return self._tokenizer

    def span_protocol(self) -> SpanProtocol:
        # The server's minipic config is not visible from here: explicit ids
        # (given to the constructor) or the tokenizer's defaults, as on the server.
        return self._protocol or SpanProtocol.from_tokenizer(self.get_tokenizer())

    async def complete(self, prompt: Sequence[int], *, max_tokens: int,
                       temperature: float = 0.0) -> Completion:
        started_at = time.monotonic()
        response = await self.client.completions.create(
            model=self.model, prompt=list(prompt), max_tokens=max_tokens,
            temperature=temperature)
        usage = response.usage
        details = getattr(usage, "prompt_tokens_details", None) if usage else None
        return Completion(
            text=response.choices[0].text,
            prompt_tokens=usage.prompt_tokens if usage else len(prompt),
            cached_tokens=getattr(details, "cached_tokens", None),
            started_at=started_at, finished_at=time.monotonic())

    async def preload_documents(self, texts: Sequence[str], *, span_tokens: int,
                                skip_span_keys: Iterable[str] = ()) -> list[list[PreloadedSpan]]:
        """Each document's spans, cut and prefilled by the server (no local tokenizer)."""
        if self.server_settings is None:
            raise RuntimeError("preload_documents needs the server's settings: connect "
                               "without trust_server=True")
        return await preload_documents(self.client, self.server_settings, texts,
                                       span_tokens=span_tokens, skip_span_keys=skip_span_keys)

    async def close(self) -> None:
        await self.client.close()
