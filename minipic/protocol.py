"""The span protocol: which token ids mark spans, shared by server and client.

A `SpanProtocol` is small and serialisable (a dict of ints), so the server's
configuration and every client tool agree on the same marker ids. It is used by
the engine-core block hasher (to recognise SSep/PDep blocks) and by the client
prompt builders (to insert markers and padding).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Iterator, Mapping, NoReturn, Sequence

# Tokenizers such as Llama-3's ship reserved special tokens that no text ever
# produces; they make safe markers. We pick the lowest-numbered ones.
_RESERVED_TOKEN = re.compile(r"reserved", re.IGNORECASE)
_FIELDS = ("ssep_token_id", "pdep_token_id", "pad_token_id")
_OPTIONAL_FIELDS = ("link_token_id",)  # EPIC link blocks need it; protocols without it refuse them


class SpanProtocolError(ValueError):
    """The span protocol cannot be resolved or is inconsistent."""


class MisplacedMarkerError(ValueError):
    """A prompt has a span marker where it would not act as one (a request error)."""


@dataclasses.dataclass(frozen=True)
class SpanProtocol:
    """Marker token ids. SSep starts an independent span, PDep starts a block
    that depends on everything before it, padding fills spans to a block boundary.
    A link block (EPIC) carries the first block(s) of the k-th span again, computed
    in context at that span's positions (see minipic.attention.span_layout)."""

    ssep_token_id: int
    pdep_token_id: int
    pad_token_id: int
    link_token_id: int | None = None

    def __post_init__(self) -> None:
        ids = [getattr(self, f) for f in self.fields()]
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise SpanProtocolError(f"marker ids must be non-negative ints, got {ids}")
        if len(set(ids)) != len(ids):
            raise SpanProtocolError(f"SSep, PDep, padding and link must be different tokens, "
                                    f"got {self.to_dict()}")

    def fields(self) -> tuple[str, ...]:
        """The names of the ids this protocol sets."""
        return _FIELDS + tuple(f for f in _OPTIONAL_FIELDS if getattr(self, f) is not None)

    @functools.cached_property
    def markers(self) -> frozenset[int]:
        """Tokens that act at a block start: SSep, PDep and link (built once: prompt
        checks read it for every block)."""
        found = (self.ssep_token_id, self.pdep_token_id, self.link_token_id)
        return frozenset(t for t in found if t is not None)

    def marker_names(self) -> dict[int, str]:
        names = {self.ssep_token_id: "SSep", self.pdep_token_id: "PDep"}
        if self.link_token_id is not None:
            names[self.link_token_id] = "link"
        return names

    def to_dict(self) -> dict[str, int]:
        # Only the ids set: a protocol without link ids keeps its pre-link form
        # (store namespaces and manifests name it).
        return {f: getattr(self, f) for f in self.fields()}

    def check_marker_placement(self, token_ids: Sequence[int], block_size: int) -> None:
        """Raise MisplacedMarkerError if an SSep, PDep or link marker sits anywhere but at
        a block start.

        The block hasher reads a marker only as a block's first token; one inside a
        block would be hashed as a plain token, and the prompt's spans would silently
        miss (or its task be hashed as part of a span). Checked for every request, so
        in C, no Python loop over the prompt: the tokens that start no block (a copy less
        every block_size-th), one set lookup each."""
        inside_blocks = list(token_ids)
        del inside_blocks[::block_size]
        if not self.markers.isdisjoint(inside_blocks):
            self._raise_misplaced(token_ids, block_size)
        check_links(token_ids[::block_size], self, block_size)

    def _raise_misplaced(self, tokens: Sequence[int], block_size: int) -> NoReturn:
        """The error for the first marker inside a block (a Python loop: errors only)."""
        markers = self.markers
        position = next(i for i, token in enumerate(tokens)
                        if i % block_size and token in markers)
        marker = tokens[position]
        raise MisplacedMarkerError(
            f"prompt token {position} is minipic's {self.marker_names()[marker]} marker "
            f"(token id {marker}), which must start a KV block (block size {block_size}): "
            "pad before it to the block boundary (minipic.client's prompt builders do), "
            "or remove it from the text")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SpanProtocol":
        missing = [f for f in _FIELDS if f not in data]
        if missing:
            raise SpanProtocolError(f"span protocol lacks {missing}")
        present = [f for f in _FIELDS + _OPTIONAL_FIELDS if data.get(f) is not None]
        return cls(**{f: _as_id(data[f], f) for f in present})

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> "SpanProtocol":
        """Default markers: the tokenizer's lowest reserved special tokens (SSep, PDep,
        padding, and link when there is a fourth)."""
        added = tokenizer.get_added_vocab()  # {token: id}, HF tokenizers API
        reserved = sorted(i for tok, i in added.items() if _RESERVED_TOKEN.search(tok))
        if len(reserved) < 3:
            name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
            raise SpanProtocolError(
                f"tokenizer {name!r} has {len(reserved)} reserved special tokens, "
                "minipic needs 3 unused ids for SSep, PDep and padding, and a 4th for "
                "EPIC links: name them with ssep_token_id, pdep_token_id, pad_token_id "
                "and link_token_id in minipic's config"
            )
        return cls(*reserved[:4])


def _as_id(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise SpanProtocolError(f"{field} must be a token id, got {value!r}")
    try:
        return int(value)
    except ValueError:
        raise SpanProtocolError(f"{field} must be a token id, got {value!r}") from None


def check_links(block_first_tokens: Sequence[int], protocol: SpanProtocol,
                block_size: int) -> None:
    """Raise MisplacedMarkerError unless every link segment has a span to stand for.

    The k-th link segment (a link block and the plain blocks after it) replaces the
    first blocks of the k-th SSep span, so that span must come before it and be at
    least as long. Anything else would leave link tokens without a position. No PDep
    block may sit between a span and its link: attention hides the span's head from
    every query outside spans, which there would precede the link standing for it
    (and its KV would depend on a later block its hash does not cover). The links
    form one run: what follows them stands as many positions earlier as they hold
    (span_layout.SpanLayout), which a second run would make depend on later blocks.
    Only marker blocks change a segment: the walk visits those (a 40-document prompt
    has some 80 of its 2,500 blocks), and a segment's length is the gap to the next."""
    if protocol.link_token_id is None:
        return
    firsts = block_first_tokens
    if not isinstance(firsts, list):
        firsts = list(firsts)
    markers = protocol.markers
    total_links = firsts.count(protocol.link_token_id)
    marker_blocks = sorted(b for m in markers for b in _positions(firsts, m))
    spans: list[int] = []  # length in blocks of each SSep span so far
    links = 0
    kind = None
    segment_start = 0  # the block that started the current segment
    run_ended = False  # a link run was followed by another marker
    # The prompt's end acts as a PDep block past its last block: it closes the last segment.
    for block in marker_blocks + [len(firsts)]:
        first = firsts[block] if block < len(firsts) else protocol.pdep_token_id
        if kind == "span":
            spans[-1] = block - segment_start
        if first == protocol.pdep_token_id and block < len(firsts) \
                and links < min(len(spans), total_links):
            raise MisplacedMarkerError(
                f"prompt token {block * block_size} starts a PDep block between span "
                f"{links + 1} and its link: put every link before the task (as "
                "minipic.client.epic does)")
        if kind == "link":
            _check_link_fits(links, block - segment_start, spans, segment_start, block_size)
            run_ended = first != protocol.link_token_id
        kind = {protocol.ssep_token_id: "span", protocol.link_token_id: "link"}.get(first)
        if kind == "link" and run_ended and block < len(firsts):
            raise MisplacedMarkerError(
                f"prompt token {block * block_size} starts a second run of link blocks: "
                "a prompt's links follow one another after its spans (as "
                "minipic.client.epic lays them out)")
        if kind == "span":
            spans.append(0)
        elif kind == "link":
            links += 1
            if links > len(spans):
                raise MisplacedMarkerError(
                    f"prompt token {block * block_size} starts link block {links}, but only "
                    f"{len(spans)} SSep span(s) come before it: link k carries the first "
                    "block of the k-th span and must follow it")
        segment_start = block


def _positions(items: list, value: int) -> Iterator[int]:
    """Every index of `value` in `items`, found by list.index (a scan in C)."""
    position = -1
    while True:
        try:
            position = items.index(value, position + 1)
        except ValueError:
            return
        yield position


def _check_link_fits(link: int, length: int, spans: list[int], start: int,
                     block_size: int) -> None:
    if length > spans[link - 1]:
        raise MisplacedMarkerError(
            f"prompt token {start * block_size} starts link block {link}, {length} blocks long, "
            f"but span {link} is {spans[link - 1]} block(s): a link replaces at most its span "
            "(end the link segment with the next marker, e.g. PDep before the task)")


def resolve_span_protocol(options: Mapping[str, Any], tokenizer_path: str | None,
                          **tokenizer_kwargs: Any) -> SpanProtocol:
    """Explicit ids in `options` win; otherwise derive them from the tokenizer."""
    if any(f in options for f in _FIELDS):
        return SpanProtocol.from_dict(options)
    if tokenizer_path is None:
        raise SpanProtocolError(
            "no tokenizer to pick minipic's marker tokens from: set ssep_token_id, "
            "pdep_token_id and pad_token_id in minipic's config"
        )
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, **tokenizer_kwargs)
    except (OSError, ValueError) as e:
        raise SpanProtocolError(
            f"cannot load tokenizer {tokenizer_path!r} to pick minipic's markers ({e}); "
            "set ssep_token_id, pdep_token_id and pad_token_id in minipic's config"
        ) from e
    return SpanProtocol.from_tokenizer(tokenizer)
