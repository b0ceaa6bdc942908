"""The body of POST /v1/minipic/preload, checked before any work (API server process).

    {"documents": ["text of one document", ...],   # required, non-empty
     "span_tokens": 512,                            # optional: longest span, in tokens
     "skip_span_keys": ["<span_key>", ...]}         # optional: spans known to be stored

Everything a client could get wrong is refused here with HTTP 400 and a message
that says how to fix it, so the route never sends the engine a request that
would fail later: the server answers for one whole request or refuses it whole.
`span_tokens` defaults to the size chat `documents` use (DEFAULT_SPAN_TOKENS), so
what a preload stores is what a chat request with the same text hits.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from minipic.client.prompts.document_spans import DEFAULT_SPAN_TOKENS, span_window
from minipic.request_errors import MinipicRequestError

REQUEST_KEYS = ("documents", "span_tokens", "skip_span_keys")
EXAMPLE = '{"documents": ["text of one document", "text of another"]}'


class PreloadRequestError(MinipicRequestError):
    """A preload request minipic refuses (HTTP 400); the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class PreloadRequest:
    documents: list[str]
    span_tokens: int  # the span size in force: rounded down to whole KV blocks
    skip_span_keys: frozenset[str]


def parse_preload_request(body: Any, *, block_size: int, max_model_len: int) -> PreloadRequest:
    """The request, or PreloadRequestError naming the first thing wrong with it."""
    if not isinstance(body, Mapping):
        raise PreloadRequestError(f"the body must be a JSON object such as {EXAMPLE}")
    unknown = sorted(set(body) - set(REQUEST_KEYS))
    if unknown:
        raise PreloadRequestError(f"unknown key(s) {', '.join(map(repr, unknown))}; the "
                                  f"keys are {', '.join(map(repr, REQUEST_KEYS))}")
    return PreloadRequest(
        documents=_documents(body.get("documents")),
        span_tokens=_span_tokens(body.get("span_tokens", DEFAULT_SPAN_TOKENS), block_size,
                                 max_model_len),
        skip_span_keys=_skip_span_keys(body.get("skip_span_keys", [])))


def _documents(documents: Any) -> list[str]:
    if not isinstance(documents, list) or not documents:
        raise PreloadRequestError(f'"documents" must be a non-empty list of texts, such as '
                                  f"{EXAMPLE}")
    for i, text in enumerate(documents):
        if not isinstance(text, str):
            raise PreloadRequestError(
                f"documents[{i}] must be a string (the document's text), got "
                f"{type(text).__name__}; for a chat document with a title send "
                '"title\\ntext", as chat lays it out')
        if not text.strip():
            raise PreloadRequestError(f"documents[{i}] is empty: send documents with text")
    return documents


def _span_tokens(value: Any, block_size: int, max_model_len: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 1:
        raise PreloadRequestError(f'"span_tokens" must be an integer > 1, got {value!r}')
    window = span_window(value, block_size)
    # A span prefill sends the span and one probe token, and generates one more.
    if window + 2 > max_model_len:
        raise PreloadRequestError(
            f"spans of {window} tokens do not fit this server's max_model_len "
            f"{max_model_len} (a span prefill sends the span, one probe token and generates "
            f"one): send span_tokens {max_model_len - 2} or less")
    return window


def _skip_span_keys(keys: Any) -> frozenset[str]:
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise PreloadRequestError('"skip_span_keys" must be a list of span keys (strings) '
                                  "from an earlier answer")
    return frozenset(keys)
