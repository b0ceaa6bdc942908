"""Front end: refuse generating from a prompt that ends inside an SSep span or a link.

Tokens inside an SSep span attend to their span only (minipic.attention.span_layout),
and so do the tokens generated after a prompt whose last block belongs to one:
`[system][SSep doc1][SSep doc2]` answers from doc2 alone, as if system and doc1
were not there. That is what a span prefill wants (minipic's tools send the span
plus one padding token with max_tokens=1 and discard the token), and almost never
what a question wants, which belongs after a PDep task (the prompt builders put it
there). So such a prompt is refused unless the request

  * asks for at most one token (a span prefill: `max_tokens=1`), or
  * opts in: `SamplingParams(extra_args={"minipic_end_in_span": True})`, over the
    OpenAI API `"vllm_xargs": {"minipic_end_in_span": 1}`.

A prompt ending inside an EPIC link segment is refused for more than one token with
no opt-in: generated tokens would sit at the link's shifted positions, and their keys'
frames would follow the prompt's length, not the block hashes that cache them.
"""

from __future__ import annotations

from typing import Any, Sequence

from minipic.protocol import SpanProtocol
from minipic.request_errors import PromptEndsInSpanError

OPT_IN_KEY = "minipic_end_in_span"


def last_marker(token_ids: Sequence[int], protocol: SpanProtocol,
                block_size: int) -> tuple[int, int] | None:
    """(start, marker) of the segment holding the prompt's last token (None: no marker).

    Markers act only at block starts: walk back over block starts to the nearest marker."""
    markers = protocol.markers
    for start in range((len(token_ids) - 1) // block_size * block_size, -1, -block_size):
        if token_ids[start] in markers:
            return start, token_ids[start]
    return None


def opted_in(sampling_params: Any) -> bool:
    max_tokens = getattr(sampling_params, "max_tokens", None)
    if max_tokens is not None and max_tokens <= 1:
        return True
    extra = getattr(sampling_params, "extra_args", None) or {}
    return extra.get(OPT_IN_KEY) in (True, 1, "1", "true", "True")


def check_prompt_end(token_ids: Sequence[int], sampling_params: Any, protocol: SpanProtocol,
                     block_size: int) -> None:
    """Raise PromptEndsInSpanError for a generation that would see only the last span."""
    if sampling_params is None or not token_ids:
        return  # pooling requests generate nothing
    found = last_marker(token_ids, protocol, block_size)
    if found is None:
        return
    start, marker = found
    max_tokens = getattr(sampling_params, "max_tokens", None)
    if marker == protocol.link_token_id and (max_tokens is None or max_tokens > 1):
        raise PromptEndsInSpanError(
            f"the prompt ends inside the EPIC link segment that starts at token {start}: "
            "generated tokens would take the link's positions. End the prompt with a PDep "
            "task (minipic.client.epic does), or send max_tokens=1")
    if marker == protocol.ssep_token_id and not opted_in(sampling_params):
        raise PromptEndsInSpanError(
            f"the prompt ends inside the SSep span that starts at token {start}: generated "
            "tokens would see only that span, not the prompt before it. Put the question "
            "after a PDep task (minipic.client's prompt builders do), send max_tokens=1 to "
            f"prefill the span, or opt in with the request's extra_args / vllm_xargs "
            f"{{\"{OPT_IN_KEY}\": 1}}")
