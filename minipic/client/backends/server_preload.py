"""Documents prefilled by a minipic server, through POST /v1/minipic/preload (client process).

The client sends text; the server cuts it into spans with its own tokenizer,
block size and markers, prefills them through its engine and answers with each
span's token ids, key and status (the route: minipic/serving/preload_route.py).
So `minipic-preload --url` needs no tokenizer, and the spans it records are the
ones the server's chat `documents` hit. The answer is checked against the
settings the client read when it connected: spans laid out for other settings
would not be what later prompts carry.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence

from minipic.client.backends.server_settings import (NotAMinipicServerError, ServerSettings,
                                                     SettingsDisagreeError)
from minipic.protocol import SpanProtocol
from minipic.serving.preload_route import PRELOAD_PATH  # the server's route, one spelling


class DocumentRefusedError(ValueError):
    """The server refused the documents (HTTP 400); the message is its reason."""


@dataclasses.dataclass(frozen=True)
class PreloadedSpan:
    span_key: str
    token_ids: list[int]
    status: str  # "new", "stored", "skipped" (not sent to the engine) or "failed"
    cached_tokens: int | None
    error: str | None


async def preload_documents(client: Any, settings: ServerSettings, texts: Sequence[str], *,
                            span_tokens: int, skip_span_keys: Iterable[str] = ()
                            ) -> list[list[PreloadedSpan]]:
    """Each document's spans as the server cut and prefilled them, in order.

    `client` is the backend's `openai.AsyncOpenAI` (its base URL, API key, timeout
    and retries); `span_tokens` is the span size already rounded to whole blocks.
    """
    import openai

    body = {"documents": list(texts), "span_tokens": span_tokens,
            "skip_span_keys": sorted(skip_span_keys)}
    try:
        answer = await client.post(PRELOAD_PATH.removeprefix("/v1"), body=body, cast_to=object)
    except openai.BadRequestError as e:
        raise DocumentRefusedError(_message(e)) from None
    except openai.NotFoundError:
        raise NotAMinipicServerError(
            f"the server has no minipic preload route (POST {PRELOAD_PATH}: 404): its minipic "
            "is older than this client's, or was switched off. Upgrade minipic on the server, "
            "or preload with token ids: --trust-server --block-size N (needs the tokenizer "
            "here)") from None
    _check_layout(answer, settings, span_tokens)
    return [[_span(s) for s in document["spans"]] for document in answer["documents"]]


def _message(error: Any) -> str:
    body = getattr(error, "body", None)
    return str(body.get("message", error)) if isinstance(body, dict) else str(error)


def _check_layout(answer: dict, settings: ServerSettings, span_tokens: int) -> None:
    """The server laid the spans out as the client records them (it may have been
    restarted with other settings since the client connected)."""
    layout = (answer["block_size"], answer["span_tokens"],
              SpanProtocol.from_dict(answer["span_protocol"]))
    if layout != (settings.block_size, span_tokens, settings.protocol):
        raise SettingsDisagreeError(
            f"the server cut spans with block size {layout[0]}, span_tokens {layout[1]} and "
            f"markers {layout[2].to_dict()}, not the block size {settings.block_size}, "
            f"span_tokens {span_tokens} and markers {settings.protocol.to_dict()} it "
            "published when this run started (restarted with other settings?): run again")


def _span(data: dict) -> PreloadedSpan:
    return PreloadedSpan(span_key=data["span_key"], token_ids=list(data["token_ids"]),
                         status=data["status"], cached_tokens=data["cached_tokens"],
                         error=data.get("error"))
