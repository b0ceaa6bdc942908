"""The span protocol: which token ids mark spans, shared by server and client.

A `SpanProtocol` is small and serialisable (a dict of ints), so the server's
configuration and every client tool agree on the same marker ids. It is used by
the engine-core block hasher (to recognise SSep/PDep blocks) and by the client
prompt builders (to insert markers and padding).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Sequence

# Tokenizers such as Llama-3's ship reserved special tokens that no text ever
# produces; they make safe markers. We pick the three lowest-numbered ones.
_RESERVED_TOKEN = re.compile(r"reserved", re.IGNORECASE)
_FIELDS = ("ssep_token_id", "pdep_token_id", "pad_token_id")


class SpanProtocolError(ValueError):
    """The span protocol cannot be resolved or is inconsistent."""


class MisplacedMarkerError(ValueError):
    """A prompt has a span marker where it would not act as one (a request error)."""


@dataclasses.dataclass(frozen=True)
class SpanProtocol:
    """Marker token ids. SSep starts an independent span, PDep starts a block
    that depends on everything before it, padding fills spans to a block boundary."""

    ssep_token_id: int
    pdep_token_id: int
    pad_token_id: int

    def __post_init__(self) -> None:
        ids = [getattr(self, f) for f in _FIELDS]
        if any(not isinstance(i, int) or i < 0 for i in ids):
            raise SpanProtocolError(f"marker ids must be non-negative ints, got {ids}")
        if len({self.ssep_token_id, self.pdep_token_id}) != 2:
            raise SpanProtocolError("SSep and PDep must be different tokens")
        if self.pad_token_id in (self.ssep_token_id, self.pdep_token_id):
            raise SpanProtocolError("the padding token must differ from SSep and PDep")

    @property
    def markers(self) -> frozenset[int]:
        return frozenset((self.ssep_token_id, self.pdep_token_id))

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def check_marker_placement(self, token_ids: Sequence[int], block_size: int) -> None:
        """Raise MisplacedMarkerError if SSep or PDep sits anywhere but at a block start.

        The block hasher reads a marker only as a block's first token; one inside a
        block would be hashed as a plain token, and the prompt's spans would silently
        miss (or its task be hashed as part of a span). `list.index` scans in C: a
        10k-token prompt costs microseconds, checked for every request."""
        tokens = token_ids if isinstance(token_ids, list) else list(token_ids)
        for marker, name in ((self.ssep_token_id, "SSep"), (self.pdep_token_id, "PDep")):
            position = -1
            while True:
                try:
                    position = tokens.index(marker, position + 1)
                except ValueError:
                    break
                if position % block_size:
                    raise MisplacedMarkerError(
                        f"prompt token {position} is minipic's {name} marker (token id "
                        f"{marker}), which must start a KV block (block size {block_size}): "
                        "pad before it to the block boundary (minipic.client's prompt "
                        "builders do), or remove it from the text")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SpanProtocol":
        missing = [f for f in _FIELDS if f not in data]
        if missing:
            raise SpanProtocolError(f"span protocol lacks {missing}")
        return cls(**{f: int(data[f]) for f in _FIELDS})

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> "SpanProtocol":
        """Default markers: the tokenizer's three lowest reserved special tokens."""
        added = tokenizer.get_added_vocab()  # {token: id}, HF tokenizers API
        reserved = sorted(i for tok, i in added.items() if _RESERVED_TOKEN.search(tok))
        if len(reserved) < 3:
            name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
            raise SpanProtocolError(
                f"tokenizer {name!r} has {len(reserved)} reserved special tokens, "
                "minipic needs 3 unused ids for SSep, PDep and padding: name them "
                "with ssep_token_id, pdep_token_id and pad_token_id in minipic's config"
            )
        return cls(*reserved[:3])


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
