"""minipic.routing without an engine: span hashes against vLLM's own Request and
hasher, the event forms, and replica scores from real vLLM event objects."""

from __future__ import annotations

import msgspec
import pytest
from vllm import SamplingParams
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.request import Request

from minipic.hashing.block_hasher import UnsupportedHashAlgoError, make_request_block_hasher
from minipic.protocol import SpanProtocol
from minipic.routing import ReplicaIndex, ReplicaScore, decode_event_batch, span_block_hashes

B = 32
PROTOCOL = SpanProtocol(3, 4, 5, 6)
HEADER = [1] + list(range(10, 10 + B - 1))
DOC_A = [3] + list(range(100, 163))  # two blocks
DOC_B = [3] + list(range(200, 231))  # one block
TASK = [4] + list(range(50, 90))  # one full block and a partial one


def engine_hashes(prompt: list[int], cache_salt: str | None = None) -> list[bytes]:
    """What the engine core computes: vLLM's Request with minipic's hasher."""
    hasher = make_request_block_hasher(PROTOCOL, B, get_hash_fn_by_name("sha256"))
    request = Request("r", prompt, SamplingParams(max_tokens=1), None,
                      cache_salt=cache_salt, block_hasher=hasher)
    return [bytes(h) for h in request.block_hashes]


def spans_of(prompt, **kwargs):
    return span_block_hashes(prompt, PROTOCOL, B, int_hashes=False, **kwargs)


def flat(spans) -> list:
    return [h for s in spans for h in s.block_hashes]


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_span_hashes_are_the_engine_hashes(salt):
    prompt = HEADER + DOC_A + DOC_B + TASK
    spans = spans_of(prompt, cache_salt=salt)
    assert [(s.kind, s.start, s.end, len(s.block_hashes)) for s in spans] == [
        ("header", 0, 32, 1), ("ssep", 32, 96, 2), ("ssep", 96, 128, 1), ("pdep", 128, 169, 1)]
    assert flat(spans) == engine_hashes(prompt, salt)


def test_ssep_span_hashes_ignore_offset_and_pdep_hashes_do_not():
    one = spans_of(HEADER + DOC_A + TASK)
    two = spans_of(HEADER + DOC_B + DOC_A + TASK)
    alone = spans_of(DOC_A)
    assert one[1].block_hashes == two[2].block_hashes == alone[0].block_hashes
    assert one[-1].block_hashes != two[-1].block_hashes


def test_int_form_is_what_vllm_publishes_by_default():
    raw = spans_of(HEADER + DOC_A)
    as_ints = span_block_hashes(HEADER + DOC_A, PROTOCOL, B, int_hashes=True)
    default = span_block_hashes(HEADER + DOC_A, PROTOCOL, B)  # follows vLLM's env (1)
    assert flat(as_ints) == flat(default) == [maybe_convert_block_hash(h) for h in flat(raw)]
    assert all(isinstance(h, int) for h in flat(as_ints))


def test_a_hash_algo_without_a_fixed_seed_is_refused():
    with pytest.raises(UnsupportedHashAlgoError, match="xxhash"):
        span_block_hashes(DOC_A, PROTOCOL, B, hash_algo="xxhash")


def stored(hashes, medium="GPU") -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[],
                       block_size=B, lora_id=None, medium=medium, lora_name=None)


def test_scores_follow_stored_and_removed_events_through_msgpack():
    final = spans_of(HEADER + DOC_B + DOC_A + TASK)
    header, doc_b, doc_a = (s.block_hashes for s in final[:3])
    batch = KVEventBatch(ts=0.0, events=[
        stored(header), stored(spans_of(DOC_A)[0].block_hashes), stored(doc_b, "CPU"),
        BlockRemoved(block_hashes=[doc_a[1]], medium="GPU")])
    index = ReplicaIndex()
    index.apply("r0", decode_event_batch(msgspec.msgpack.encode(batch)).events)
    index.apply("r1", [stored(header), stored(doc_b), stored(doc_a)])
    # r0: header, doc_b (CPU) and doc_a's first block: the run breaks at doc_a's second.
    assert index.score("r0", final) == ReplicaScore(3 * B, 3 * B)
    assert index.score("r1", final) == ReplicaScore(4 * B, 4 * B)
    assert [r for r, _ in index.rank(final)] == ["r1", "r0"]
    index.apply("r1", [AllBlocksCleared()])
    assert index.score("r1", final) == ReplicaScore(0, 0)


def test_a_block_aligned_prompt_never_hits_its_last_block():
    spans = spans_of(HEADER + DOC_A)
    index = ReplicaIndex()
    index.apply("r0", [stored(flat(spans))])
    assert index.score("r0", spans) == ReplicaScore(2 * B, 3 * B)
