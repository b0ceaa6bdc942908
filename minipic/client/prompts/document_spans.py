"""Cut a document into spans: the one layout shared by the preload tool and the RAG client.

A document of any length becomes consecutive windows of at most
`span_tokens - 1` tokens, each wrapped as [SSep] + window + padding. The
preload tool prefills these spans; the RAG client, given the same text and
span size, rebuilds the very same token ids, so its final prompts hit what was
preloaded. `span_key` names a span by its token ids, for manifests and for
de-duplicating prefills (two documents may share a span).
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

from minipic.client.prompts.span_prompt import SpanPromptError, check_block_size, make_span, to_tokens
from minipic.protocol import SpanProtocol

DEFAULT_SPAN_TOKENS = 512


def span_window(span_tokens: int, block_size: int) -> int:
    """`span_tokens` rounded down to whole blocks (at least one): a span's size."""
    block_size = check_block_size(block_size)
    if isinstance(span_tokens, bool) or not isinstance(span_tokens, int) or span_tokens <= 1:
        raise ValueError(f"span_tokens must be an int > 1, got {span_tokens!r}")
    return max(block_size, span_tokens - span_tokens % block_size)


def document_spans(document: str | Sequence[int], *, protocol: SpanProtocol, block_size: int,
                   span_tokens: int = DEFAULT_SPAN_TOKENS, tokenizer: Any = None,
                   where: str = "document") -> list[list[int]]:
    """The document's spans, each [SSep] + up to span_tokens - 1 tokens, padded to a block."""
    tokens = to_tokens(document, tokenizer, where)
    if not tokens:
        raise SpanPromptError(f"{where} is empty")
    body = span_window(span_tokens, block_size) - 1  # SSep takes the first slot
    return [make_span(tokens[start:start + body], protocol, block_size, f"{where}, span {i}")
            for i, start in enumerate(range(0, len(tokens), body))]


def span_key(span: Sequence[int]) -> str:
    """A stable name for a span's token ids (client side; not the engine's block hash)."""
    data = ",".join(map(str, span)).encode()
    return hashlib.sha256(data).hexdigest()[:32]
