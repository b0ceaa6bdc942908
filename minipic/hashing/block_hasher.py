"""Engine-core side: block hashes with SSep chain resets and PDep full-context hashes.

For each full block b of a request (tokens x_b, stock extra keys e_b); markers
count in the prompt only, generated tokens never start a span:
  * x_b starts with SSep: h_b = H(seed, x_b, e_b + salt)        -- chain reset
  * x_b starts with PDep or link: h_b = H(H(seed, "pdep", h_0..h_{b-1}), x_b, e_b + salt)
  * otherwise:            h_b = H(h_{b-1} or seed, x_b, e_b)    -- stock chaining
The PDep hash commits to every earlier block hash, hence to every earlier token
and extra key (the paper's fork hashed only the block itself: a false-hit bug).
A link block (EPIC) is computed in context at an earlier span's positions, so its
KV depends on everything before it: it is hashed as PDep is (its own first token
tells them apart).
`salt` is the request's cache_salt: stock vLLM keys only block 0 with it (in a
version-specific form), which a chain reset would drop, so every reset block
carries it again, in one form at every offset.

With no markers this is exactly vLLM's chaining with the same hash function
and seed, so hashes equal stock vLLM 0.32's (with PYTHONHASHSEED unset; minipic
pins the seed on every version and ignores PYTHONHASHSEED).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from minipic.protocol import SpanProtocol

# Hash algorithms whose seed may be fixed: collision resistant, so a public
# seed is harmless, and deterministic across processes, restarts, machines.
SUPPORTED_HASH_ALGOS = ("sha256", "sha256_cbor")
# vLLM 0.32 derives NONE_HASH from this seed for cryptographic hashes unless
# PYTHONHASHSEED is set; 0.25 used a random one. minipic always uses it, so
# stores persist and replicas agree whatever PYTHONHASHSEED each process has.
SEED = "vllm-none-hash"


class UnsupportedHashAlgoError(ValueError):
    pass


def deterministic_seed(hash_fn: Callable[[Any], bytes]) -> bytes:
    """The chain seed (vLLM's NONE_HASH), the same in every process."""
    return hash_fn(SEED)


def check_hash_algo(name: str) -> None:
    if name not in SUPPORTED_HASH_ALGOS:
        raise UnsupportedHashAlgoError(
            f"minipic needs deterministic block hashes (spans are shared across "
            f"processes, restarts and replicas); prefix_caching_hash_algo={name!r} is not "
            f"collision resistant with a public seed. Use one of {SUPPORTED_HASH_ALGOS}."
        )


class _WithoutSalt:
    """A request as vLLM's extra-key function would see it without a cache_salt.

    Stock vLLM keys block 0 with the salt, in a version-specific form (0.25: the
    bare string, 0.32: a tagged pair). A marker block must be keyed the same at
    every offset, so it takes the stock keys without the salt and adds its own.
    """

    cache_salt = None

    def __init__(self, request: Any):
        self._request = request

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


class SpanBlockHasher:
    """Hashes one block given its predecessors; independent of vLLM's Request."""

    def __init__(self, protocol: SpanProtocol, hash_fn: Callable[[Any], bytes],
                 hash_block_tokens: Callable[..., bytes], seed: bytes):
        self.protocol = protocol
        self.markers = protocol.markers  # a frozenset built once, read per block
        self.hash_fn = hash_fn
        self.hash_block_tokens = hash_block_tokens
        self.seed = seed

    def parent_of(self, first_token: int, previous: Sequence[bytes]) -> bytes:
        if first_token == self.protocol.ssep_token_id:
            return self.seed
        if first_token in (self.protocol.pdep_token_id, self.protocol.link_token_id):
            return self.hash_fn((self.seed, "minipic-pdep", tuple(previous)))
        return previous[-1] if previous else self.seed

    def plain_hash(self, tokens: Sequence[int], previous: Sequence[bytes],
                   extra_keys: tuple | None) -> bytes:
        """A block that starts no segment: chained on its predecessor, as stock vLLM does."""
        return self.hash_block_tokens(self.hash_fn, previous[-1] if previous else self.seed,
                                      tokens, extra_keys)

    def hash_block(self, tokens: Sequence[int], previous: Sequence[bytes],
                   extra_keys: tuple | None, cache_salt: str | None,
                   in_prompt: bool = True) -> bytes:
        """`extra_keys` of a marker block must come without vLLM's block-0 salt."""
        # Markers act in prompts only: generated tokens are never a span boundary.
        if not in_prompt or tokens[0] not in self.markers:
            return self.plain_hash(tokens, previous, extra_keys)
        if cache_salt:  # every chain reset carries the tenant's salt again
            extra_keys = (*(extra_keys or ()), ("minipic-cache-salt", cache_salt))
        parent = self.parent_of(tokens[0], previous)
        return self.hash_block_tokens(self.hash_fn, parent, tokens, extra_keys)


def prompt_length(request: Any) -> int:
    """The prompt's length as of now. In a streamed-input session vLLM extends
    `prompt_token_ids`, hashes the new blocks and only then updates
    `num_prompt_tokens` (Scheduler._update_request_as_session, 0.25.1 and 0.32.0):
    the list, not the count, says where the prompt ends while they are hashed."""
    prompt = request.prompt_token_ids
    return len(prompt) if prompt is not None else request.num_prompt_tokens


def make_request_block_hasher(protocol: SpanProtocol, hash_block_size: int,
                              hash_fn: Callable[[Any], bytes]) -> Callable[[Any], list]:
    """A drop-in for vLLM's `get_request_block_hasher(...)` result."""
    from vllm.v1.core import kv_cache_utils as kcu

    seed = deterministic_seed(hash_fn)
    hasher = SpanBlockHasher(protocol, hash_fn, kcu.hash_block_tokens, seed)

    def request_block_hasher(request: Any) -> list:
        first_new = len(request.block_hashes)
        start, mm_idx = first_new * hash_block_size, 0
        if start + hash_block_size > request.num_tokens:
            return []  # called every step; most steps complete no block
        hashes: list = list(request.block_hashes)
        # Read once, not per block (a 40k-token prompt has 2.5k): in the engine core's input
        # thread every microsecond a block delays the request's first step. A plain block is
        # hashed as in vLLM's own loop (its hash_block_tokens returns a BlockHash already).
        prompt_end, token_ids = prompt_length(request), request.all_token_ids
        markers, num_tokens = hasher.markers, request.num_tokens
        extra_keys_of, hash_tokens = kcu.generate_block_hash_extra_keys, kcu.hash_block_tokens
        parent = hashes[-1] if hashes else seed
        while start + hash_block_size <= num_tokens:
            end = start + hash_block_size
            tokens = token_ids[start:end]
            if start < prompt_end and tokens[0] in markers:
                # Stock extra keys (LoRA, multimodal, prompt embeds), without the block-0
                # salt. mm_idx restarts at 0 here; vLLM skips ahead only as an optimisation.
                extra_keys, mm_idx = extra_keys_of(_WithoutSalt(request), start, end, mm_idx)
                parent = kcu.BlockHash(hasher.hash_block(tokens, hashes, extra_keys,
                                                         request.cache_salt))
            else:
                extra_keys, mm_idx = extra_keys_of(request, start, end, mm_idx)
                parent = hash_tokens(hash_fn, parent, tokens, extra_keys)
            hashes.append(parent)
            start = end
        return hashes[first_new:]

    return request_block_hasher
