"""Router side (any process with vLLM installed): a prompt's block hashes, per span,
exactly as the engine publishes them in its KV events.

The hashes come from the engine's own code path: minipic's request block hasher
(SpanBlockHasher, the pinned seed) over vLLM's hash function and its extra-key
function, run on a prompt-only stand-in for vLLM's Request. Nothing is
re-derived here, so a router and the engine cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from minipic.hashing.block_hasher import check_hash_algo, make_request_block_hasher
from minipic.protocol import SpanProtocol

# What starts a span, by its first block's first token; "header" is what precedes
# the first marker (chained as in stock vLLM).
HEADER, SSEP, PDEP, LINK = "header", "ssep", "pdep", "link"


@dataclasses.dataclass(frozen=True)
class SpanHashes:
    """One span of a prompt: tokens [start, end) and the hashes of its full blocks.

    `kind` says how its first block is hashed: "ssep" alone (the same at every
    offset), "pdep" and "link" over every earlier block, "header" chained from
    block 0. Later blocks of a span chain on its first block.
    """

    kind: str
    start: int
    end: int
    block_size: int
    block_hashes: tuple


class _PromptOnly:
    """What the engine's block hasher and vLLM's extra-key function read of a
    Request, for a prompt with no output, LoRA, multimodal input or embeddings."""

    def __init__(self, prompt: list[int], cache_salt: str | None):
        self.prompt_token_ids = self.all_token_ids = prompt
        self.num_tokens = self.num_prompt_tokens = len(prompt)
        self.cache_salt = cache_salt
        self.block_hashes: list = []
        self.mm_features: list = []
        self.lora_request = None
        self.prompt_embeds = None


def _hash_fn(hash_algo: str):
    check_hash_algo(hash_algo)
    try:
        from vllm.utils.hashing import get_hash_fn_by_name
    except ImportError:  # older vLLM keeps it in vllm.utils
        from vllm.utils import get_hash_fn_by_name
    return get_hash_fn_by_name(hash_algo)


def _event_form(block_hash: bytes, int_hashes: bool | None) -> Any:
    """bytes, or the int vLLM publishes when VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1
    (its default): None follows this process's setting, as the engine does."""
    if int_hashes is None:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        return maybe_convert_block_hash(block_hash)
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1) if int_hashes else bytes(block_hash)


def prompt_block_hashes(prompt_token_ids: Sequence[int], protocol: SpanProtocol,
                        block_size: int, hash_algo: str = "sha256",
                        cache_salt: str | None = None) -> list[bytes]:
    """The engine's hash of every full block of the prompt, raw bytes."""
    prompt = list(prompt_token_ids)
    hasher = make_request_block_hasher(protocol, block_size, _hash_fn(hash_algo))
    return [bytes(h) for h in hasher(_PromptOnly(prompt, cache_salt))]


def _kind(first_token: int, protocol: SpanProtocol) -> str | None:
    kinds = {protocol.ssep_token_id: SSEP, protocol.pdep_token_id: PDEP}
    if protocol.link_token_id is not None:
        kinds[protocol.link_token_id] = LINK
    return kinds.get(first_token)


def _span_starts(prompt: list[int], protocol: SpanProtocol, block_size: int) -> list[int]:
    # Markers act only as a block's first token (the engine refuses them elsewhere).
    starts = [b for b in range(0, len(prompt), block_size) if _kind(prompt[b], protocol)]
    return starts if starts and starts[0] == 0 else [0, *starts]


def span_block_hashes(prompt_token_ids: Sequence[int], protocol: SpanProtocol,
                      block_size: int, hash_algo: str = "sha256",
                      cache_salt: str | None = None,
                      int_hashes: bool | None = None) -> list[SpanHashes]:
    """For each span of the prompt, the hashes its full blocks have in KV events.

    `block_size` and `hash_algo` are the engine's (`--block-size`,
    `--prefix-caching-hash-algo`), `cache_salt` the request's. A trailing partial
    block has no hash (vLLM caches full blocks only).
    """
    prompt = list(prompt_token_ids)
    hashes = prompt_block_hashes(prompt, protocol, block_size, hash_algo, cache_salt)
    starts = _span_starts(prompt, protocol, block_size) if prompt else []
    spans = []
    for start, end in zip(starts, [*starts[1:], len(prompt)]):
        blocks = hashes[start // block_size:end // block_size]
        kind = _kind(prompt[start], protocol) or HEADER
        spans.append(SpanHashes(kind, start, end, block_size,
                                tuple(_event_form(h, int_hashes) for h in blocks)))
    return spans
