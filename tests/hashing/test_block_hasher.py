"""minipic's block hasher on vLLM's own Request objects (engine-core code path, no engine)."""

from __future__ import annotations

from vllm import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.request import Request

from minipic.hashing.block_hasher import make_request_block_hasher
from minipic.protocol import SpanProtocol

B = 32
SSEP, PDEP = 3, 4
HASHER = make_request_block_hasher(SpanProtocol(SSEP, PDEP, 5), B, get_hash_fn_by_name("sha256"))
SPAN = [SSEP] + list(range(100, 163))  # two blocks
HEADER = list(range(10, 10 + B))


def hashes(prompt: list[int], cache_salt: str | None = None, outputs: list[int] = ()) -> list:
    request = Request("r", prompt, SamplingParams(max_tokens=len(outputs) + 1), None,
                      cache_salt=cache_salt, block_hasher=HASHER)
    if outputs:
        request.append_output_token_ids(list(outputs))
    return list(request.block_hashes)


def test_span_hashes_ignore_offset():
    assert hashes(SPAN) == hashes(HEADER + SPAN)[1:]


def test_salted_span_hashes_ignore_offset_and_differ_by_salt():
    # Stock vLLM salts block 0 only: the span alone (at block 0) and after a
    # header must still hash alike, and never like another tenant's span.
    assert hashes(SPAN, "a") == hashes(HEADER + SPAN, "a")[1:]
    assert hashes(SPAN, "a") != hashes(SPAN, "b")
    assert hashes(SPAN, "a") != hashes(SPAN)


def test_generated_marker_does_not_reset_the_chain():
    prompt = HEADER + list(range(200, 200 + B))
    generated = [SSEP] + list(range(300, 300 + B - 1))
    with_marker = hashes(prompt, outputs=generated)
    plain = hashes(prompt, outputs=[7] + generated[1:])
    alone = hashes(generated)  # the same block as an SSep prompt block
    assert len(with_marker) == 3 and with_marker[2] != alone[0]
    assert with_marker[:2] == plain[:2]


def test_pdep_depends_on_every_earlier_block():
    task = [PDEP] + list(range(50, 50 + B - 1))
    other_span = [SSEP] + list(range(170, 233))
    assert hashes(HEADER + SPAN + task)[-1] != hashes(HEADER + other_span + task)[-1]
    assert hashes(HEADER + SPAN + task)[-1] == hashes(HEADER + SPAN + task)[-1]


def test_markers_in_a_streamed_prompt_chunk_count():
    """A streamed-input session appends prompt tokens the way the scheduler does
    (Scheduler._update_request_as_session): the new span must hash as a span."""
    request = Request("r", list(HEADER), SamplingParams(max_tokens=1), None, block_hasher=HASHER)
    request.prompt_token_ids.extend(SPAN)
    request._all_token_ids.extend(SPAN)
    request.update_block_hashes()
    request.num_prompt_tokens = len(request.prompt_token_ids)
    assert list(request.block_hashes) == hashes(HEADER + SPAN)
    assert list(request.block_hashes)[1:] == hashes(SPAN)


def test_a_prompt_without_markers_hashes_as_stock_vllm(monkeypatch):
    """Plain blocks take vLLM's own chaining (hash_block_tokens from the same seed), salt
    and generated tokens included: stock's prefix cache and minipic's agree on them."""
    from vllm.v1.core import kv_cache_utils as kcu

    from minipic.hashing.block_hasher import deterministic_seed

    hash_fn = get_hash_fn_by_name("sha256")
    # stock's seed, as vLLM 0.32 derives it with PYTHONHASHSEED unset
    monkeypatch.setattr(kcu, "NONE_HASH", deterministic_seed(hash_fn), raising=False)
    stock = kcu.get_request_block_hasher(B, hash_fn)
    prompt = list(range(10, 10 + 5 * B + 7))
    for salt in (None, "tenant"):
        theirs = Request("r", prompt, SamplingParams(max_tokens=B + 1), None, cache_salt=salt,
                         block_hasher=stock)
        ours = Request("r", prompt, SamplingParams(max_tokens=B + 1), None, cache_salt=salt,
                       block_hasher=HASHER)
        for request in (theirs, ours):  # a generated block completes a sixth
            request.append_output_token_ids(list(range(500, 500 + B)))
        assert len(ours.block_hashes) == 6
        assert list(ours.block_hashes) == list(theirs.block_hashes)
