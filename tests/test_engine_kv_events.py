"""minipic.routing against the KV events a real vLLM CPU engine publishes over ZMQ:
the hashes it computes are the engine's bytes, SSep spans keep theirs at every offset,
PDep blocks do not, and the replica score is the engine's num_cached_tokens."""

from __future__ import annotations

import random
import socket

import pytest
import zmq
from conftest import BLOCK_SIZE, MINIPIC_ON, start_llm, stop_llm

from minipic.client import block_attention
from minipic.protocol import SpanProtocol
from minipic.routing import ReplicaIndex, decode_event_batch, span_block_hashes

pytestmark = pytest.mark.engine
TOPIC = "kv"


def words(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(7, 400) for _ in range(n)]


SYSTEM, TASK = words(20, 5), words(40, 4)  # the task fills a PDep block
DOC_1, DOC_2, DOC_3 = words(20, 1), words(50, 2), words(20, 3)  # 1, 2 and 1 blocks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def engine(tiny_model):
    """An engine publishing KV events (raw bytes hashes) and a subscriber to them.
    The subscriber connects first: PUB drops what is sent before a peer joins."""
    port = free_port()
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
    sub.connect(f"tcp://127.0.0.1:{port}")
    events = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{port}", "topic": TOPIC}
    llm = start_llm(tiny_model, kv_events_config=events, **MINIPIC_ON)
    yield llm, sub
    stop_llm(llm)
    sub.close(linger=0)
    mp.undo()


def run(llm, sub, prompts: list[list[int]]) -> tuple[list, list]:
    """Generate one token per prompt, in order; the engine's outputs and the
    BlockStored events published meanwhile."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outputs = [llm.generate(TokensPrompt(prompt_token_ids=p), SamplingParams(max_tokens=1),
                            use_tqdm=False)[0] for p in prompts]
    stored = []
    while sub.poll(2000):  # the publisher thread sends after each step
        _, _, payload = sub.recv_multipart()
        stored += [e for e in decode_event_batch(payload).events
                   if type(e).__name__ == "BlockStored"]
    return outputs, stored


def hashes(prompt, protocol) -> list:
    return span_block_hashes(prompt, protocol, BLOCK_SIZE)


def event_hashes_of(stored, blocks: list[int]) -> list[tuple[bytes, bytes | None]]:
    """(hash, parent) the events give the blocks with these token ids, in order;
    the parent is the block before it in the request that stored it."""
    found = []
    for event in stored:
        parents = [event.parent_block_hash, *event.block_hashes]
        for i, h in enumerate(event.block_hashes):
            if event.token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE] == blocks:
                found.append((h, parents[i]))
    return found


def test_events_carry_the_span_hashes_and_scores_match_vllm(engine):
    llm, sub = engine
    protocol = SpanProtocol.from_tokenizer(llm.get_tokenizer())
    build = lambda docs: block_attention(docs, TASK, system=SYSTEM, protocol=protocol,  # noqa
                                         block_size=BLOCK_SIZE)
    first, second = build([DOC_1, DOC_3]).final, build([DOC_2, DOC_3]).final
    # No prefills: each final prompt computes and stores all its blocks, DOC_3 at
    # two offsets (after DOC_1, one block, and after DOC_2, two).
    _, stored = run(llm, sub, [first, second])
    spans_1, spans_2 = hashes(first, protocol), hashes(second, protocol)
    ours = {h for s in spans_1 + spans_2 for h in s.block_hashes}
    published = {h for e in stored for h in e.block_hashes}
    assert ours == published and all(isinstance(h, bytes) and len(h) == 32 for h in ours)

    doc_3_1, doc_3_2 = spans_1[2], spans_2[2]
    assert doc_3_1.kind == "ssep" and doc_3_1.start != doc_3_2.start
    assert doc_3_1.block_hashes == doc_3_2.block_hashes
    doc_3_block = first[doc_3_1.start:doc_3_1.start + BLOCK_SIZE]
    (hash_1, parent_1), (hash_2, parent_2) = event_hashes_of(stored, doc_3_block)
    assert hash_1 == hash_2 == doc_3_1.block_hashes[0]
    assert parent_1 == spans_1[1].block_hashes[-1] != parent_2 == spans_2[1].block_hashes[-1]

    task_1, task_2 = spans_1[-1], spans_2[-1]
    assert task_1.kind == "pdep" and task_1.block_hashes != task_2.block_hashes
    task_block = first[task_1.start:task_1.start + BLOCK_SIZE]
    assert [h for h, _ in event_hashes_of(stored, task_block)] == [
        *task_1.block_hashes, *task_2.block_hashes]

    # A third arrangement at new offsets: the score from the events is the hit.
    index = ReplicaIndex()
    index.apply("r0", stored)
    third = build([DOC_3, DOC_2, DOC_1]).final
    score = index.score("r0", hashes(third, protocol))
    (output,), _ = run(llm, sub, [third])
    # Header and the three documents (five blocks) hit; the PDep task after them is new.
    assert score.hit_tokens == output.num_cached_tokens == 5 * BLOCK_SIZE
    assert index.score("r1", hashes(third, protocol)).hit_tokens == 0
