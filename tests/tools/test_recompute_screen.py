"""tools/recompute_screen.py: its own layout builder gives what minipic's rules give.

The screen builds its layouts from the rules, not from minipic's SpanLayout, so it can try
block choices the engine does not make; it is only worth its numbers if, for the choices
both make, the two agree (accuracy_variants' layouts come from SpanLayout and match the
engine's recorded logprobs, docs/accuracy.md)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import accuracy_variants  # noqa: E402
import recompute_screen  # noqa: E402



@pytest.fixture(scope="module")
def setup(smollm2_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from minipic.devtools.smollm2 import smollm2_protocol
    from minipic.devtools.synthetic_qa import chat_parts, encode, make_questions
    from minipic.protocol import SpanProtocol

    tokenizer = AutoTokenizer.from_pretrained(smollm2_model)
    model = AutoModelForCausalLM.from_pretrained(smollm2_model, torch_dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    question = make_questions(2)[1]
    header, texts, task = chat_parts(tokenizer, question)
    docs = recompute_screen.Documents(encode(tokenizer, header),
                                      [encode(tokenizer, t) for t in texts],
                                      encode(tokenizer, task), 32)
    gold = accuracy_variants.gold_tokens(tokenizer, question)
    return model, tokenizer, SpanProtocol(**smollm2_protocol()), question, docs, gold


def _first_token(model, layout, gold):
    return recompute_screen.answer_logprobs(model, layout, gold)[0]


@pytest.mark.real_model
@pytest.mark.parametrize("rules, variant", [("none", "block_attention_noroom_sink"),
                                            ("first:1", "epic1_noroom_sink"),
                                            ("first:2", "epic2_noroom_sink")])
def test_layout_matches_minipics_span_layout(setup, rules, variant):
    model, tokenizer, protocol, question, docs, gold = setup
    chosen = recompute_screen.chosen_tokens(rules, tokenizer, question, docs)
    mine = _first_token(model, recompute_screen.build_layout(docs, chosen), gold)
    built = accuracy_variants.build(variant, question, tokenizer, protocol)
    n = len(built.tokens)
    theirs = recompute_screen.Layout(built.tokens, built.allowed, built.positions,
                                     torch.zeros(n, n, dtype=torch.bool))
    reference = _first_token(model, theirs, gold)
    assert (mine - reference).abs().max() < 1e-3


@pytest.mark.real_model
def test_every_block_recomputed_is_stock(setup):
    model, tokenizer, _, question, docs, gold = setup
    every = {(i, j) for i, body in enumerate(docs.bodies) for j in range(len(body))}
    stock = _first_token(model, recompute_screen.stock_layout(docs), gold)
    recomputed = _first_token(model, recompute_screen.build_layout(docs, every), gold)
    assert (stock - recomputed).abs().max() < 1e-3
    # and a solo-computed document is not: the comparison can fail
    alone = _first_token(model, recompute_screen.build_layout(docs, set()), gold)
    assert (stock - alone).abs().max() > 0.1


@pytest.mark.real_model
def test_the_explicit_attention_is_sdpa_at_scale_one_and_scaling_changes_it(setup):
    from transformers import AttentionInterface

    AttentionInterface.register("minipic_scaled", recompute_screen.scaled_attention)
    model, tokenizer, _, question, docs, gold = setup
    layout = recompute_screen.build_layout(docs, docs.block_tokens(0, 0))
    plain = recompute_screen.answer_logprobs(model, layout, gold)[0]  # sdpa
    explicit = recompute_screen.answer_logprobs(model, layout, gold, 1.0 + 1e-9, 1.0)[0]
    softened = recompute_screen.answer_logprobs(model, layout, gold, 1.25, 1.0)[0]
    assert (plain - explicit).abs().max() < 1e-3
    assert (plain - softened).abs().max() > 1e-2


@pytest.mark.real_model
def test_lexical_blocks_pick_the_named_documents_blocks(setup):
    _, tokenizer, _, question, docs, _ = setup
    picked = recompute_screen.lexical_blocks(tokenizer, question.text, docs, 2)
    assert {doc for doc, _ in picked} == {question.answer_doc}


def _toy() -> "recompute_screen.Documents":
    # header 2 tokens; two documents of 5 body tokens in blocks of 3 (block 0: marker + 2)
    return recompute_screen.Documents([1, 2], [[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]],
                                      [30, 31], 3)


def _index(layout, token: int, occurrence: int = 0) -> int:
    return [i for i, t in enumerate(layout.tokens) if t == token][occurrence]


def test_a_later_blocks_link_sees_its_documents_solo_head_and_replaces_its_own_block():
    docs = _toy()
    layout = recompute_screen.build_layout(docs, docs.block_tokens(0, 1) | docs.block_tokens(1, 0))
    link_12 = _index(layout, 12, 1)  # doc 0's block 1 (body 2..4), recomputed
    seen = {layout.tokens[k] for k in range(len(layout.tokens)) if layout.allowed[link_12, k]}
    assert seen == {1, 2, 10, 11, 12}  # header, doc 0's solo head, itself,
    assert not layout.allowed[link_12, _index(layout, 12, 0)]  # not the solo block it replaces
    task = _index(layout, 31)
    solo, linked = _index(layout, 13, 0), _index(layout, 13, 1)
    assert not layout.allowed[task, solo] and layout.allowed[task, linked]
    assert layout.allowed[task, _index(layout, 23, 0)]  # doc 1's block 1 stays solo
    assert not layout.allowed[task, _index(layout, 20, 0)]  # doc 1's head: its link instead
    assert layout.positions[linked] == layout.positions[solo] == 5
    # doc 1's solo tail was computed alone: it sees its marker and own head, nothing else
    tail = _index(layout, 23, 0)
    assert {layout.tokens[k] for k in range(tail + 1) if layout.allowed[tail, k]} \
        == {recompute_screen.MARKER, 20, 21, 22, 23}
    # scaling reaches the task's and links' attention to solo keys that are not replaced
    assert layout.scaled[task, _index(layout, 23, 0)] and not layout.scaled[task, solo]
    assert not layout.scaled[tail, _index(layout, 21, 0)]


def test_recomputed_fraction_counts_tokens_and_block_0_holds_the_marker():
    docs = _toy()
    assert docs.recomputed_fraction(docs.block_tokens(0, 0)) == 2 / 10  # marker + 2 body
    assert docs.recomputed_fraction(docs.block_tokens(0, 1) | docs.block_tokens(1, 1)) == 6 / 10


@pytest.mark.parametrize("name", ["first", "first:x", "nope:1", "first:1@1.25"])
def test_an_unreadable_variant_is_refused_before_the_model_loads(name):
    with pytest.raises(SystemExit, match="cannot read"):
        recompute_screen.check_variant(name)


def test_single_tokens_recomputed_see_their_documents_solo_tokens_between_them():
    docs = _toy()
    layout = recompute_screen.build_layout(docs, {(0, 1), (0, 3)})  # tokens 11 and 13
    link_13 = _index(layout, 13, 1)
    seen = [k for k in range(len(layout.tokens)) if layout.allowed[link_13, k]]
    assert [layout.tokens[k] for k in seen] == [1, 2, 10, 12, 11, 13]  # 11, 13 recomputed
    assert _index(layout, 11, 0) not in seen and _index(layout, 12, 0) in seen


def test_most_deviating_takes_the_share_asked():
    deviation = {(0, j): float(j) for j in range(10)}
    assert recompute_screen.most_deviating(deviation, 20) == {(0, 9), (0, 8)}


@pytest.mark.real_model
def test_deviation_compares_each_token_with_itself(setup):
    """Entering layer 0 a token's state is its embedding, computed alone or not: a deviation
    there means the two sequences' tokens were paired wrongly."""
    model, _, _, _, docs, _ = setup
    at_embedding = recompute_screen.token_deviation(model, docs, layer=0)
    assert len(at_embedding) == sum(len(body) for body in docs.bodies)
    assert max(at_embedding.values()) < 1e-5
    assert max(recompute_screen.token_deviation(model, docs, layer=1).values()) > 1e-2
