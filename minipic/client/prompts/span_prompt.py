"""Span building blocks: padding, SSep spans, PDep tasks, and the `SpanPrompt` result.

The engine hashes a block by its first token only (see
minipic/hashing/block_hasher.py), so everything here is about putting the
right marker at the first token of the right block:
  * a span is [SSep] + body + padding to a multiple of the block size, so it
    hashes the same wherever it lands, and whatever follows starts a fresh block;
  * a task is [PDep] + body, so its block hashes over all earlier context and
    never hits a cache entry computed after different documents.
Markers anywhere else are refused: one inside a body would be harmless to the
hasher mid-block but would start a wrongly hashed block once lengths shift.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Sequence, Union

from minipic.protocol import SpanProtocol

# Every recipe input: text (needs a tokenizer) or token ids.
TextOrTokens = Union[str, Sequence[int]]


class SpanPromptError(ValueError):
    """A span prompt cannot be built from these inputs; the message says where."""


def check_block_size(block_size: Any) -> int:
    """The engine's KV block size: spans are only reusable when padded to it."""
    if block_size is None:
        raise SpanPromptError(
            "block_size is required: pass the serving engine's KV cache block size "
            "(vLLM's --block-size / cache_config.block_size, e.g. 16 on GPU)"
        )
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise SpanPromptError(f"block_size must be an int, got {block_size!r}")
    if block_size <= 0:
        raise SpanPromptError(f"block_size must be positive, got {block_size}")
    return block_size


def as_token_ids(tokens: Sequence[int], where: str) -> list[int]:
    # operator.index accepts numpy ints but refuses floats that int() would truncate.
    try:
        return [operator.index(t) for t in tokens]
    except TypeError as e:
        raise SpanPromptError(f"{where}: token ids must be ints ({e})") from None


def to_tokens(piece: TextOrTokens, tokenizer: Any, where: str) -> list[int]:
    """Text (encoded without special tokens, so no stray BOS) or token ids."""
    if isinstance(piece, str):
        if tokenizer is None:
            raise SpanPromptError(f"{where} is text: pass a tokenizer, or token ids")
        return list(tokenizer.encode(piece, add_special_tokens=False))
    if isinstance(piece, (bytes, int)) or not hasattr(piece, "__iter__"):
        raise SpanPromptError(f"{where} must be text or token ids, got {type(piece).__name__}")
    return as_token_ids(piece, where)


def check_body(tokens: Sequence[int], protocol: SpanProtocol, where: str) -> None:
    """A body may not contain a marker (SSep, PDep, link): they only belong at block starts;
    nor padding, which only ends a header or a span: with mask_markers padding takes no
    room, and inside a span it would make the tokens after the span overlap it."""
    names = {token: f"the {name} marker" for token, name in protocol.marker_names().items()}
    names[protocol.pad_token_id] = "the padding token"
    for position, token in enumerate(tokens):
        if token in names:
            raise SpanPromptError(
                f"{where} contains {names[token]} (token id {token}) at position {position}; "
                "span markers and padding may only be placed by the builder"
            )


def pad_to_block(tokens: Sequence[int], block_size: int, pad_id: int) -> list[int]:
    """Append pad_id until len is a multiple of block_size (no-op when aligned)."""
    block_size = check_block_size(block_size)
    return list(tokens) + [pad_id] * (-len(tokens) % block_size)


def make_span(tokens: Sequence[int], protocol: SpanProtocol, block_size: int,
              where: str = "span") -> list[int]:
    """[SSep] + tokens + padding: hashes the same at any block-aligned offset."""
    if not tokens:
        raise SpanPromptError(f"{where} is empty")
    check_body(tokens, protocol, where)
    return pad_to_block([protocol.ssep_token_id, *tokens], block_size, protocol.pad_token_id)


def make_task(tokens: Sequence[int], protocol: SpanProtocol, where: str = "task") -> list[int]:
    """[PDep] + tokens: its block hashes over everything before it."""
    check_body(tokens, protocol, where)
    return [protocol.pdep_token_id, *tokens]


def check_span(span: Sequence[int], protocol: SpanProtocol, block_size: int,
               where: str = "span") -> list[int]:
    """Validate a pre-built span (e.g. from make_span) and return it as a list."""
    span = as_token_ids(span, where)
    if not span or span[0] != protocol.ssep_token_id:
        raise SpanPromptError(f"{where} is not a span: it must start with SSep")
    if len(span) % check_block_size(block_size):
        raise SpanPromptError(
            f"{where} has {len(span)} tokens, not a multiple of block_size {block_size}: "
            "pad it (make_span does) so the next marker starts a block"
        )
    body = span[1:]
    while body and body[-1] == protocol.pad_token_id:  # its padding: a trailing run only
        body = body[:-1]
    if not body:
        raise SpanPromptError(f"{where} is empty (only SSep and padding)")
    check_body(body, protocol, where)
    return span


def span_from(piece: TextOrTokens, protocol: SpanProtocol, block_size: int,
              tokenizer: Any, where: str) -> list[int]:
    """A span from text, a body of token ids, or a pre-built span (starts with SSep)."""
    tokens = to_tokens(piece, tokenizer, where)
    if not isinstance(piece, str) and tokens[:1] == [protocol.ssep_token_id]:
        return check_span(tokens, protocol, block_size, where)
    return make_span(tokens, protocol, block_size, where)


def make_header(system: Sequence[int], bos_token_id: int | None, protocol: SpanProtocol,
                block_size: int) -> list[int]:
    """[BOS] + system + padding, or [] when there is neither.

    The header is both the final prompt's first blocks and a prefill request of
    its own, chained normally from block 0; BOS goes here and only here so that
    block 0 is token-for-token the same in both (spans never carry a BOS).
    """
    check_body(system, protocol, "system prompt")
    header = list(system)
    if bos_token_id is not None and header[:1] != [bos_token_id]:
        header.insert(0, bos_token_id)
    return pad_to_block(header, block_size, protocol.pad_token_id)


def bos_of(tokenizer: Any) -> int | None:
    return None if tokenizer is None else getattr(tokenizer, "bos_token_id", None)


def tokens_prompt(token_ids: Sequence[int]) -> Any:
    """`vllm.inputs.TokensPrompt` for LLM.generate (vLLM imported only when asked)."""
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=list(token_ids))


@dataclasses.dataclass(frozen=True)
class SpanPrompt:
    """What to send: every span_prefills request first (each alone), then final.

    expected_cached_tokens is how many tokens of `final` vLLM should report as
    cached (num_cached_tokens) once the prefills ran; see expected_hits.py.
    """

    span_prefills: list[list[int]]
    final: list[int]
    expected_cached_tokens: int
    block_size: int

    @classmethod
    def build(cls, span_prefills: Sequence[Sequence[int]], final: Sequence[int],
              protocol: SpanProtocol, block_size: int) -> "SpanPrompt":
        from minipic.client.prompts.expected_hits import expected_cached_tokens

        # A span used twice needs one prefill; keep first-use order.
        unique = list(dict.fromkeys(tuple(p) for p in span_prefills))
        prefills = [list(p) for p in unique]
        final = list(final)
        cached = expected_cached_tokens(final, prefills, protocol, block_size)
        return cls(prefills, final, cached, block_size)

    def vllm_prefills(self) -> list[Any]:
        return [tokens_prompt(p) for p in self.span_prefills]

    def vllm_final(self) -> Any:
        return tokens_prompt(self.final)

    def openai_prefills(self) -> list[list[int]]:
        """A batch `prompt` for the OpenAI completions API (token ids)."""
        return [list(p) for p in self.span_prefills]

    def openai_final(self) -> list[int]:
        """The `prompt` for the OpenAI completions API (token ids)."""
        return list(self.final)
