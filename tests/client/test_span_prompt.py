"""Client span prompt builder: layouts, expected hits, errors, and hash agreement.

Pure unit tests (no engine). The hashing test replays minipic's engine-core
hasher with vLLM's own hash_block_tokens and sha256.
"""

from __future__ import annotations

import itertools

import pytest

from minipic.client import (
    PromptCache, SpanPrompt, SpanPromptError, Text, block_attention, check_span, epic,
    make_span, make_task, pad_to_block,
)
from minipic.devtools.tiny_llama import build_tokenizer
from minipic.protocol import SpanProtocol

B = 4  # small blocks keep the layouts readable
DOCS = [
    "paris is the capital of france",
    "berlin is the capital city of germany and the river",
    "rome",
]
TASK = "what is the capital of france ?"
SYSTEM = "you are a helpful assistant"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def protocol(tokenizer):
    return SpanProtocol.from_tokenizer(tokenizer)


def ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def marker_positions(tokens, protocol):
    return [i for i, t in enumerate(tokens) if t in protocol.markers]


def find_slice(haystack, needle, step):
    """Block-aligned offsets where needle occurs in haystack."""
    return [o for o in range(0, len(haystack) - len(needle) + 1, step)
            if haystack[o:o + len(needle)] == needle]


# --- low level -------------------------------------------------------------

def test_pad_to_block():
    assert pad_to_block([7, 8, 9], 4, 0) == [7, 8, 9, 0]
    assert pad_to_block([7, 8, 9, 6], 4, 0) == [7, 8, 9, 6]
    assert pad_to_block([], 4, 0) == []
    assert pad_to_block([1] * 5, 32, 0) == [1] * 5 + [0] * 27


@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("length", [1, 3, 15, 16, 31, 40])
def test_make_span_alignment(protocol, block_size, length):
    span = make_span([100] * length, protocol, block_size)
    assert span[0] == protocol.ssep_token_id
    assert len(span) % block_size == 0
    assert len(span) - (1 + length) < block_size  # never a whole block of padding
    assert span[1:1 + length] == [100] * length
    assert set(span[1 + length:]) <= {protocol.pad_token_id}
    assert check_span(span, protocol, block_size) == span


def test_make_task(protocol):
    assert make_task([10, 11], protocol) == [protocol.pdep_token_id, 10, 11]


# --- Block-Attention ---------------------------------------------------------

def test_block_attention_layout(tokenizer, protocol):
    p = block_attention(DOCS, TASK, system=SYSTEM, protocol=protocol, block_size=B,
                        tokenizer=tokenizer)
    header, *spans = p.span_prefills
    assert header == pad_to_block([tokenizer.bos_token_id, *ids(tokenizer, SYSTEM)], B,
                                  protocol.pad_token_id)
    assert spans == [make_span(ids(tokenizer, d), protocol, B) for d in DOCS]
    task = make_task(ids(tokenizer, TASK), protocol)
    assert p.final == header + sum(spans, []) + task
    # BOS only at the start of the final prompt and of the system request.
    assert [i for i, t in enumerate(p.final) if t == tokenizer.bos_token_id] == [0]
    assert all(s[0] != tokenizer.bos_token_id for s in spans)
    # Markers only at block starts: every span and the task start a block.
    starts = marker_positions(p.final, protocol)
    assert all(i % B == 0 for i in starts)
    assert len(starts) == len(DOCS) + 1 and p.final[starts[-1]] == protocol.pdep_token_id
    assert p.expected_cached_tokens == len(header) + sum(map(len, spans))
    assert p.block_size == B


def test_block_attention_token_ids_without_tokenizer(tokenizer, protocol):
    docs = [ids(tokenizer, d) for d in DOCS]
    p = block_attention(docs, ids(tokenizer, TASK), protocol=protocol, block_size=B)
    assert p.span_prefills == [make_span(d, protocol, B) for d in docs]  # no header
    assert p.final[0] == protocol.ssep_token_id
    assert p.expected_cached_tokens == sum(map(len, p.span_prefills))


def test_block_attention_bos_not_doubled(tokenizer, protocol):
    system = [tokenizer.bos_token_id, *ids(tokenizer, SYSTEM)]
    a = block_attention(DOCS, TASK, system=system, protocol=protocol, block_size=B,
                        tokenizer=tokenizer)
    b = block_attention(DOCS, TASK, system=SYSTEM, protocol=protocol, block_size=B,
                        tokenizer=tokenizer)
    assert a == b


def test_bos_only_header_still_hits(tokenizer, protocol):
    p = block_attention(DOCS, TASK, protocol=protocol, block_size=B, tokenizer=tokenizer)
    assert p.span_prefills[0] == pad_to_block([tokenizer.bos_token_id], B, protocol.pad_token_id)
    assert p.expected_cached_tokens == sum(map(len, p.span_prefills))


def test_prefills_are_aligned_slices_of_final(tokenizer, protocol):
    p = block_attention(DOCS, TASK, system=SYSTEM, protocol=protocol, block_size=B,
                        tokenizer=tokenizer)
    assert find_slice(p.final, p.span_prefills[0], B)[0] == 0
    for span in p.span_prefills:
        assert find_slice(p.final, span, B)


def test_prebuilt_and_duplicate_docs(tokenizer, protocol):
    span = make_span(ids(tokenizer, DOCS[0]), protocol, B)
    p = block_attention([span, DOCS[0], DOCS[1]], TASK, protocol=protocol, block_size=B,
                        tokenizer=tokenizer)
    assert p.span_prefills.count(span) == 1  # one prefill serves both uses
    assert len(find_slice(p.final, span, B)) == 2
    assert p.expected_cached_tokens == p.final.index(protocol.pdep_token_id)


def test_expected_cached_stops_at_first_miss(tokenizer, protocol):
    p = block_attention(DOCS, TASK, system=SYSTEM, protocol=protocol, block_size=B,
                        tokenizer=tokenizer)
    header, d0, d1, d2 = p.span_prefills
    partial = SpanPrompt.build([header, d0, d2], p.final, protocol, B)  # d1 not prefilled
    assert partial.expected_cached_tokens == len(header) + len(d0)


def test_vllm_and_openai_prompts(tokenizer, protocol):
    p = block_attention(DOCS, TASK, protocol=protocol, block_size=B, tokenizer=tokenizer)
    assert p.openai_final() == p.final
    assert p.openai_prefills() == p.span_prefills
    pytest.importorskip("vllm")
    assert p.vllm_final()["prompt_token_ids"] == p.final
    assert [q["prompt_token_ids"] for q in p.vllm_prefills()] == p.span_prefills


# --- EPIC --------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2])
def test_epic_layout(tokenizer, protocol, k):
    long, short = DOCS[1], DOCS[2]  # 10 tokens (3 blocks as a span), 1 token (1 block)
    p = epic([long, short], TASK, recompute_blocks=k, system=SYSTEM, protocol=protocol,
             block_size=B, tokenizer=tokenizer)
    header = p.span_prefills[0]
    spans = [make_span(ids(tokenizer, d), protocol, B) for d in (long, short)]
    links = [[protocol.link_token_id, *span[1:k * B]] for span in spans]
    task = make_task(ids(tokenizer, TASK), protocol)
    assert p.final == header + spans[0] + spans[1] + links[0] + links[1] + task
    assert len(links[0]) == k * B and len(links[1]) == B  # a link never outgrows its span
    assert p.span_prefills == [header, *spans]
    assert all(i % B == 0 for i in marker_positions(p.final, protocol))
    # Header and every span are one contiguous hit; links and the task are computed.
    assert p.expected_cached_tokens == len(header) + len(spans[0]) + len(spans[1])


@pytest.mark.parametrize("block_size,blocks", [(4, 3), (5, 2), (12, 1), (2, 5)])
def test_epic_recomputes_tokens_in_whole_blocks(tokenizer, protocol, block_size, blocks):
    """recompute_tokens=10: as many whole blocks as hold 10 tokens, at every block size
    (the default recipe's accuracy is a number of tokens, not of blocks)."""
    kwargs = dict(system=SYSTEM, protocol=protocol, block_size=block_size, tokenizer=tokenizer)
    assert epic(DOCS, TASK, recompute_tokens=10, **kwargs) == \
        epic(DOCS, TASK, recompute_blocks=blocks, **kwargs)


def test_recompute_blocks_and_tokens_together_are_refused(tokenizer, protocol):
    """Which would win? Neither: the call says to pick one (also through epic64)."""
    from minipic.client.prompts.recipes import RECIPES_BY_NAME

    kwargs = dict(protocol=protocol, block_size=B, tokenizer=tokenizer)
    with pytest.raises(SpanPromptError, match="not both"):
        epic(DOCS, TASK, recompute_blocks=1, recompute_tokens=8, **kwargs)
    with pytest.raises(SpanPromptError, match="not both"):
        RECIPES_BY_NAME["epic64"](DOCS, TASK, recompute_blocks=1, **kwargs)
    assert epic(DOCS, TASK, **kwargs) == epic(DOCS, TASK, recompute_blocks=1, **kwargs)


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_recompute_tokens_must_be_a_count(tokenizer, protocol, bad):
    with pytest.raises(SpanPromptError, match="recompute_tokens must be an int >= 0"):
        epic(DOCS, TASK, recompute_tokens=bad, protocol=protocol, block_size=B,
             tokenizer=tokenizer)


def test_the_default_recipe_recomputes_64_tokens():
    from minipic.client.prompts.recipes import RECIPES_BY_NAME
    from minipic.config import DEFAULT_SERVER_RECIPE, SERVER_RECIPES

    assert DEFAULT_SERVER_RECIPE == "epic64" and set(SERVER_RECIPES) == set(RECIPES_BY_NAME)
    assert RECIPES_BY_NAME["epic64"].keywords == {"recompute_tokens": 64}


def test_epic_needs_a_link_marker(tokenizer, protocol):
    without_link = SpanProtocol(protocol.ssep_token_id, protocol.pdep_token_id,
                                protocol.pad_token_id)
    with pytest.raises(SpanPromptError, match="link_token_id"):
        epic(DOCS, TASK, protocol=without_link, block_size=B, tokenizer=tokenizer)


def test_epic_without_recompute_is_block_attention(tokenizer, protocol):
    kwargs = dict(system=SYSTEM, protocol=protocol, block_size=B, tokenizer=tokenizer)
    assert epic(DOCS, TASK, recompute_blocks=0, **kwargs) == block_attention(DOCS, TASK, **kwargs)


# --- Prompt Cache --------------------------------------------------------------

@pytest.fixture
def cache(tokenizer, protocol):
    return PromptCache({"paris": DOCS[0], "berlin": DOCS[1], "rome": DOCS[2]},
                       protocol=protocol, block_size=B, tokenizer=tokenizer)


def test_prompt_cache_any_order(cache, protocol, tokenizer):
    header = cache.header
    assert header == pad_to_block([tokenizer.bos_token_id], B, protocol.pad_token_id)
    assert cache.span_prefills == [header, *cache.modules.values()]
    for order in itertools.permutations(["paris", "berlin", "rome"]):
        p = cache.prompt(*order, Text(TASK))
        spans = [cache.modules[n] for n in order]
        assert p.final == header + sum(spans, []) + make_task(ids(tokenizer, TASK), protocol)
        assert p.span_prefills == [header, *spans]
        assert p.expected_cached_tokens == len(header) + sum(map(len, spans))


def test_prompt_cache_free_text(cache, protocol, tokenizer):
    text = ids(tokenizer, "read the following")  # 3 tokens
    p = cache.prompt(Text("read the"), text[2:], "rome", Text(TASK))
    free = pad_to_block([protocol.pdep_token_id, *text], B, protocol.pad_token_id)
    assert p.final == cache.header + free + cache.modules["rome"] + \
        make_task(ids(tokenizer, TASK), protocol)
    assert all(i % B == 0 for i in marker_positions(p.final, protocol))
    assert p.expected_cached_tokens == len(cache.header)  # free text never hits
    assert p.span_prefills == [cache.header, cache.modules["rome"]]


def test_prompt_cache_fully_cached_prompt_recomputes_last_block(cache):
    p = cache.prompt("rome", "paris")
    assert len(p.final) % B == 0
    assert p.expected_cached_tokens == len(p.final) - B  # vLLM needs logits of the last token


def test_prompt_cache_errors(cache, protocol):
    with pytest.raises(SpanPromptError, match=r"part 1: unknown module 'what is'"):
        cache.prompt("rome", "what is")
    with pytest.raises(SpanPromptError, match="at least one"):
        cache.prompt(Text(""))
    with pytest.raises(SpanPromptError, match=r"free text \(part 0\) contains the SSep"):
        cache.prompt([7, protocol.ssep_token_id], "rome")
    with pytest.raises(SpanPromptError, match="already registered"):
        cache.add("rome", "paris")
    cache.add("rome", DOCS[2])  # same content again: fine
    with pytest.raises(SpanPromptError, match="module 'x' is empty"):
        cache.add("x", "")


# --- errors --------------------------------------------------------------------

@pytest.mark.parametrize("bad, match", [
    (None, "block_size is required"), (0, "positive"), (-16, "positive"),
    ("16", "must be an int"), (True, "must be an int"), (16.0, "must be an int"),
])
def test_bad_block_size(protocol, bad, match):
    with pytest.raises(SpanPromptError, match=match):
        block_attention([[7]], [8], protocol=protocol, block_size=bad)
    with pytest.raises(SpanPromptError, match=match):
        PromptCache({}, protocol=protocol, block_size=bad)


@pytest.mark.parametrize("kwargs, match", [
    (dict(recompute_blocks=-1, block_size=B), "recompute_blocks must be an int >= 0"),
    (dict(recompute_blocks=1, block_size=None), "block_size is required"),
])
def test_epic_link_checks_its_arguments(protocol, kwargs, match):
    from minipic.client import epic_link

    with pytest.raises(SpanPromptError, match=match):
        epic_link(make_span([7, 8, 9], protocol, B), protocol=protocol, **kwargs)


def test_marker_in_bodies(tokenizer, protocol):
    kwargs = dict(protocol=protocol, block_size=B, tokenizer=tokenizer)
    ssep_text = tokenizer.convert_ids_to_tokens(protocol.ssep_token_id)
    with pytest.raises(SpanPromptError, match=r"document 1 contains the SSep .* position 2"):
        block_attention([DOCS[0], f"paris is {ssep_text} rome"], TASK, **kwargs)
    with pytest.raises(SpanPromptError, match=r"^task contains the PDep"):
        block_attention(DOCS, [7, protocol.pdep_token_id], **kwargs)
    with pytest.raises(SpanPromptError, match=r"^system prompt contains the SSep"):
        block_attention(DOCS, TASK, system=[protocol.ssep_token_id], **kwargs)
    with pytest.raises(SpanPromptError, match=r"document 0 contains the PDep"):
        epic([[7, 8, protocol.pdep_token_id]], TASK, **kwargs)
    with pytest.raises(SpanPromptError, match="span contains the SSep"):
        make_span([7, protocol.ssep_token_id], protocol, B)


def test_padding_ends_spans_and_nothing_else(protocol):
    """Padding inside a document would take room inside its span and none after it
    (mask_markers): the task would stand on the span's last tokens. Refused, with the
    position; a pre-built span's own trailing padding is fine."""
    pad = protocol.pad_token_id
    with pytest.raises(SpanPromptError, match=r"document 0 contains the padding token .* "
                                              r"position 1"):
        block_attention([[7, pad, 8]], [9], protocol=protocol, block_size=B)
    with pytest.raises(SpanPromptError, match="^task contains the padding token"):
        block_attention([[7, 8]], [9, pad], protocol=protocol, block_size=B)
    built = make_span([7, 8], protocol, B)  # [SSep 7 8 pad]
    assert built in block_attention([built], [9], protocol=protocol, block_size=B).span_prefills
    inner = [protocol.ssep_token_id, 7, pad, 8]
    with pytest.raises(SpanPromptError, match="document 0 contains the padding token"):
        block_attention([inner], [9], protocol=protocol, block_size=B)


def test_bad_documents(tokenizer, protocol):
    kwargs = dict(protocol=protocol, block_size=B, tokenizer=tokenizer)
    with pytest.raises(SpanPromptError, match="document 1 is empty"):
        block_attention([DOCS[0], ""], TASK, **kwargs)
    with pytest.raises(SpanPromptError, match="document 0 is empty"):
        epic([[]], TASK, **kwargs)
    with pytest.raises(SpanPromptError, match="list of documents"):
        block_attention(DOCS[0], TASK, **kwargs)
    with pytest.raises(SpanPromptError, match="document 0 is text: pass a tokenizer"):
        block_attention(DOCS, TASK, protocol=protocol, block_size=B)
    with pytest.raises(SpanPromptError, match="document 0: token ids must be ints"):
        block_attention([[1.5, 2]], TASK, **kwargs)
    with pytest.raises(SpanPromptError, match="recompute_blocks"):
        epic(DOCS, TASK, recompute_blocks=-1, **kwargs)
    with pytest.raises(SpanPromptError, match="document 0 contains the link"):
        epic([[7, protocol.link_token_id]], TASK, **kwargs)


def test_bad_prebuilt_spans(protocol):
    kwargs = dict(protocol=protocol, block_size=B)
    with pytest.raises(SpanPromptError, match="document 1 has 3 tokens, not a multiple of "
                                              "block_size 4"):
        block_attention([[7], [protocol.ssep_token_id, 7, 8]], [9], **kwargs)
    with pytest.raises(SpanPromptError, match="document 0 contains the PDep"):
        block_attention([[protocol.ssep_token_id, 7, protocol.pdep_token_id, 8]], [9], **kwargs)
    with pytest.raises(SpanPromptError, match="empty"):
        block_attention([[protocol.ssep_token_id] + [protocol.pad_token_id] * 3], [9], **kwargs)
    with pytest.raises(SpanPromptError, match="must start with SSep"):
        check_span([7, 8, 9, 10], protocol, B)


def test_error_is_value_error():
    assert issubclass(SpanPromptError, ValueError)


# --- agreement with the engine's hasher ------------------------------------------

@pytest.fixture(scope="module")
def engine_hashes(protocol):
    """Block hashes exactly as minipic's engine-core hasher computes them."""
    pytest.importorskip("vllm")
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import hash_block_tokens

    from minipic.hashing.block_hasher import SpanBlockHasher, deterministic_seed

    hasher = SpanBlockHasher(protocol, sha256, hash_block_tokens, deterministic_seed(sha256))

    def hashes(tokens, block_size):
        out = []
        for start in range(0, len(tokens) - block_size + 1, block_size):
            out.append(hasher.hash_block(tokens[start:start + block_size], out, None, None))
        return out

    return hashes


def cached_prefix(final_hashes, prefill_hashes, num_tokens, block_size):
    cached = {h for hs in prefill_hashes for h in hs}
    hits = list(itertools.takewhile(lambda h: h in cached, final_hashes))
    return min(len(hits), (num_tokens - 1) // block_size) * block_size


@pytest.mark.parametrize("block_size", [4, 16])
def test_span_hashes_match_alone_at_any_offset(tokenizer, protocol, engine_hashes, block_size):
    kwargs = dict(protocol=protocol, block_size=block_size, tokenizer=tokenizer)
    task = TASK + " " + " ".join(f"w{i}" for i in range(20))  # a full PDep block
    systems = [None, SYSTEM, SYSTEM + " " + " ".join(f"w{i}" for i in range(30))]
    orders = [DOCS, DOCS[::-1], [DOCS[1], DOCS[0], DOCS[1]]]
    seen_offsets: dict[tuple, set] = {}
    for system, docs in itertools.product(systems, orders):
        p = block_attention(docs, task, system=system, **kwargs)
        final = engine_hashes(p.final, block_size)
        prefills = [engine_hashes(s, block_size) for s in p.span_prefills]
        for span, alone in zip(p.span_prefills, prefills):
            for offset in find_slice(p.final, span, block_size):
                first = offset // block_size
                assert final[first:first + len(alone)] == alone
                seen_offsets.setdefault(tuple(span), set()).add(offset)
        # expected_cached_tokens agrees with vLLM's rules over the real hashes.
        assert p.expected_cached_tokens == cached_prefix(final, prefills, len(p.final),
                                                         block_size)
        assert p.expected_cached_tokens == p.final.index(protocol.pdep_token_id)
    doc_spans = [tuple(make_span(ids(tokenizer, d), protocol, block_size)) for d in DOCS]
    assert all(len(seen_offsets[d]) >= 3 for d in doc_spans)  # really moved around


def pdep_block_hash(p, engine_hashes, protocol):
    index = p.final.index(protocol.pdep_token_id) // B
    return engine_hashes(p.final, B)[index]


def test_pdep_hash_depends_on_documents(tokenizer, protocol, engine_hashes):
    kwargs = dict(system=SYSTEM, protocol=protocol, block_size=B, tokenizer=tokenizer)
    task = TASK + " w1 w2 w3"
    base = block_attention(DOCS, task, **kwargs)
    changed_doc = block_attention([DOCS[0], DOCS[1] + " w9", DOCS[2]], task, **kwargs)
    reordered = block_attention(DOCS[::-1], task, **kwargs)
    other_system = block_attention(DOCS, task, **{**kwargs, "system": "you are"})
    hashes = {pdep_block_hash(p, engine_hashes, protocol)
              for p in (base, changed_doc, reordered, other_system)}
    assert len(hashes) == 4
    assert pdep_block_hash(base, engine_hashes, protocol) == \
        pdep_block_hash(block_attention(DOCS, task, **kwargs), engine_hashes, protocol)


def test_epic_links_depend_on_context_spans_do_not(tokenizer, protocol, engine_hashes):
    """Links are computed in context, so they hash over everything before them (a
    link hashed like a plain block would hit after another system prompt or other
    documents: a false hit); the spans hash the same in every prompt."""
    kwargs = dict(protocol=protocol, block_size=B, tokenizer=tokenizer, recompute_blocks=2)
    docs = [" ".join(f"w{i}" for i in range(12)), DOCS[1]]
    prompts = [epic(docs, TASK, system=system, **kwargs) for system in (SYSTEM, "you are")]
    prompts.append(epic([docs[0], DOCS[0]], TASK, system=SYSTEM, **kwargs))
    link_hashes = []
    for p in prompts:
        hashes = engine_hashes(p.final, B)
        for span in p.span_prefills[1:]:
            (offset,) = find_slice(p.final, span, B)
            assert hashes[offset // B:(offset + len(span)) // B] == engine_hashes(span, B)
        first_link = p.final.index(protocol.link_token_id) // B
        link_hashes.append(hashes[first_link:first_link + 2])  # docs[0]'s link, 2 blocks
    assert len({h for hs in link_hashes for h in hs}) == 6  # all differ
    assert p.expected_cached_tokens == first_link * B
