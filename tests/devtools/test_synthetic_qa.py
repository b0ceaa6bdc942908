"""minipic.devtools.synthetic_qa: the accuracy benchmark's questions (no engine, no model)."""

from __future__ import annotations

import pytest

from minipic.devtools.synthetic_qa import (
    COLOURS, KINDS, answer_matches, make_pool, make_questions, normalise,
)


def test_same_seed_same_questions_other_seed_other_questions():
    assert make_questions(50, seed=3) == make_questions(50, seed=3)
    assert make_questions(50, seed=3) != make_questions(50, seed=4)


def test_each_question_has_one_answer_document_and_distinct_candidates():
    for q in make_questions(200):
        assert len(q.docs) == len(q.candidates) == 10
        assert q.candidates[q.answer_doc] == q.gold
        assert len(set(q.candidates)) == 10  # ranking is unambiguous
        about = [d.split(" is ", 1)[0] for d in q.docs]  # each document's country
        holders = [i for i, name in enumerate(about) if f" {name}" in q.text]
        assert holders == [q.answer_doc]  # exactly one document is about the asked country
        # the answer is started with the answer document's own words
        assert f"{q.answer_prefix} {q.gold}" in q.docs[q.answer_doc]


def test_kinds_rotate_and_documents_recur_across_questions():
    questions = make_questions(100)
    assert {q.kind for q in questions} == set(KINDS)
    docs = [d for q in questions for d in q.docs]
    assert len(set(docs)) < len(docs) / 4  # a shared pool: spans are reused


def test_names_are_unique_in_the_pool():
    pool = make_pool()
    for field in ("name", "capital", "founder", "year"):
        assert len({getattr(c, field) for c in pool}) == len(pool)
    assert {c.colour for c in pool} <= set(COLOURS)


def test_bad_question_count_is_refused():
    with pytest.raises(ValueError, match="n must be"):
        make_questions(-1)


@pytest.mark.parametrize("answer, expected", [
    ("The capital city of Velmora is Drennik.", True),
    ("drennik", True),
    ("Drennikos", False),                       # whole words only
    ("Drennik or Stoutri", False),              # naming a second candidate is a miss
    (" Drennik. The flag of Metur is blue", True),  # only the first sentence is judged
    ("I do not know.", False),
])
def test_answer_matches(answer, expected):
    assert answer_matches(answer, "Drennik", ("Drennik", "Stoutri", "Metur")) is expected


def test_normalise_drops_case_punctuation_and_articles():
    assert normalise("  The Flag, is  RED! ") == "flag is red"
