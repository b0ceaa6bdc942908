"""Synthetic multi-document QA for the accuracy benchmark (tools/bench_accuracy.py).

Every document describes one invented country (invented names, so a model can
only answer from the documents): capital, founder, founding year, flag colour,
main export. A question asks one of these about one country; its context is 10
documents, exactly one of them about that country, and its 10 candidate
answers are the asked attribute of each document (all different), for
log-likelihood ranking. Documents come from a shared pool, so the same document
recurs in many questions at different positions: the reuse position-independent
caching is for (each span is prefilled once, every later question hits it).

Pure Python and seeded: the same seed gives the same questions on any machine.
"""

from __future__ import annotations

import dataclasses
import random
import re
import string

DOCS_PER_QUESTION = 10
POOL_SIZE = 150
KINDS = ("capital", "founder", "year", "colour", "export")

# Names are compounds of common words ("Frostmark", "Bellbury"): invented, so no model
# knows their facts, but made of whole tokens a small model can match and copy
# (syllable soup like "Toveleith" vs "Tovarel" is what it confuses).
_COUNTRY_HEADS = ["Ash", "Bright", "Cold", "Deep", "Elder", "Frost", "Gold", "Green", "High",
                  "Iron", "Long", "North", "Oak", "Red", "Silver", "Stone", "Storm", "Sun",
                  "West", "Wolf", "Wind", "Black", "Moon", "Rose", "Star", "Thorn", "Amber",
                  "Raven", "Winter", "Summer"]
_COUNTRY_TAILS = ["vale", "mark", "land", "moor", "holm", "field", "gard", "haven", "reach",
                  "shire", "crest", "fall", "stead", "march"]
_CITY_HEADS = ["Port", "Lake", "Mill", "Bridge", "Castle", "Market", "King", "Queen", "Fox",
               "Bell", "Mount", "Hill", "Salt", "Wheat", "Horse", "Fish", "Church", "Cross",
               "Harbor", "Apple"]
_CITY_TAILS = ["ton", "bury", "borough", "ham", "by", "gate", "well", "side", "wick", "ford",
               "minster", "chester"]
_FIRST_NAMES = ["Anna", "Boris", "Clara", "Dmitri", "Elena", "Felix", "Greta", "Hugo", "Irene",
                "Jonas", "Karla", "Lukas", "Marta", "Nils", "Olga", "Pavel", "Rosa", "Stefan",
                "Tilda", "Viktor", "Wanda", "Yuri", "Zofia", "Oskar", "Ingrid", "Emil"]
_SURNAME_HEADS = ["Berg", "Brook", "Crane", "Dale", "Fern", "Grim", "Hart", "Holt", "Lind",
                  "Marsh", "Nord", "Quill", "Rook", "Sand", "Thorn", "Vance", "Wren"]
_SURNAME_TAILS = ["man", "ley", "ström", "wood", "ford", "son", "gren", "well", "hall"]
COLOURS = ["red", "blue", "green", "yellow", "purple", "orange", "white", "black", "grey",
           "brown", "pink", "silver"]
EXPORTS = ["copper", "salt", "wool", "timber", "silk", "amber", "tin", "wine", "honey",
           "marble", "glass", "rice", "tea", "iron"]
_REGIONS = ["far north", "eastern hills", "southern plains", "western coast", "central valley",
            "high mountains", "river delta", "northern islands"]
_TRADES = ["farming", "fishing", "mining", "weaving", "shipbuilding", "trade", "herding"]
_SIGHTS = ["old stone bridges", "painted houses", "quiet markets", "tall watchtowers",
           "long canals", "terraced gardens", "busy harbours"]

QUESTION_TEMPLATES = {
    "capital": "What is the capital city of {name}?",
    "founder": "Who founded {name}?",
    "year": "In which year was {name} founded?",
    "colour": "What colour is the flag of {name}?",
    "export": "What is the main export of {name}?",
}
# The assistant's answer starts with these words (the task ends with them).
ANSWER_PREFIXES = {
    "capital": "The capital city of {name} is",
    "founder": "The founder of {name} was",
    "year": "{name} was founded in the year",
    "colour": "The flag of {name} is",
    "export": "The main export of {name} is",
}
INSTRUCTION = "Read the documents and answer the question with a short answer."


@dataclasses.dataclass(frozen=True)
class Country:
    name: str
    capital: str
    founder: str
    year: str
    colour: str
    export: str
    region: str
    river: str
    trade: str
    sight: str
    reign: int

    def document(self) -> str:
        """About 100 tokens (SmolLM2's tokenizer) of facts, one kind of answer per sentence.

        Each answer follows the exact words of its ANSWER_PREFIXES entry: the answer
        is started with them, so a small model answers by finding the matching
        sentence (retrieval), not by rephrasing.
        """
        return (
            f"{self.name} is a small country in the {self.region}. "
            f"The capital city of {self.name} is {self.capital}, on the {self.river} river. "
            f"{self.name} was founded in the year {self.year}. "
            f"The founder of {self.name} was {self.founder}, who ruled for {self.reign} years. "
            f"The flag of {self.name} is {self.colour}. "
            f"The main export of {self.name} is {self.export}, and its people work in "
            f"{self.trade}. Visitors remember its {self.sight}."
        )

    def answer(self, kind: str) -> str:
        return getattr(self, kind)


@dataclasses.dataclass(frozen=True)
class Question:
    """One question with its 10 documents; candidates[i] is document i's answer."""

    id: int
    kind: str
    text: str
    answer_prefix: str
    gold: str
    docs: tuple[str, ...]
    candidates: tuple[str, ...]
    answer_doc: int


def _unique_names(rng: random.Random, count: int, heads: list[str],
                  tails: list[str]) -> list[str]:
    """count distinct head+tail compounds, in a seeded order."""
    names = [h + t for h in heads for t in tails]
    if count > len(names):
        raise ValueError(f"only {len(names)} names for a pool of {count}")
    return rng.sample(names, count)


def make_pool(seed: int = 0, size: int = POOL_SIZE) -> list[Country]:
    """Countries with unique names, capitals, founders and years (colours, exports and
    founders' first names repeat)."""
    rng = random.Random(f"pool-{seed}")
    names = _unique_names(rng, size, _COUNTRY_HEADS, _COUNTRY_TAILS)
    capitals = _unique_names(rng, size, _CITY_HEADS, _CITY_TAILS)
    rivers = [h + t for h in _CITY_HEADS for t in ("brook", "water", "run")]
    surnames = _unique_names(rng, size, _SURNAME_HEADS, _SURNAME_TAILS)
    years = rng.sample(range(1100, 1900), size)
    return [
        Country(name=names[i], capital=capitals[i],
                founder=f"{rng.choice(_FIRST_NAMES)} {surnames[i]}",
                year=str(years[i]), colour=rng.choice(COLOURS), export=rng.choice(EXPORTS),
                region=rng.choice(_REGIONS), river=rng.choice(rivers), trade=rng.choice(_TRADES),
                sight=rng.choice(_SIGHTS), reign=rng.randrange(5, 60))
        for i in range(size)
    ]


def _distractors(rng: random.Random, pool: list[Country], target: Country, kind: str,
                 count: int) -> list[Country]:
    """count other countries whose answers to `kind` all differ (so ranking is unambiguous)."""
    seen = {target.answer(kind)}
    chosen: list[Country] = []
    for country in rng.sample(pool, len(pool)):
        if country is not target and country.answer(kind) not in seen:
            seen.add(country.answer(kind))
            chosen.append(country)
            if len(chosen) == count:
                return chosen
    raise ValueError(f"the pool has too few distinct {kind} values for {count} distractors")


def make_questions(n: int, seed: int = 0, docs_per_question: int = DOCS_PER_QUESTION,
                   pool_size: int = POOL_SIZE) -> list[Question]:
    """n questions, kinds in rotation, target and distractor order shuffled per question."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    pool = make_pool(seed, pool_size)
    rng = random.Random(f"questions-{seed}")
    questions = []
    for qid in range(n):
        kind = KINDS[qid % len(KINDS)]
        target = rng.choice(pool)
        countries = [target, *_distractors(rng, pool, target, kind, docs_per_question - 1)]
        rng.shuffle(countries)
        questions.append(Question(
            id=qid, kind=kind, text=QUESTION_TEMPLATES[kind].format(name=target.name),
            answer_prefix=ANSWER_PREFIXES[kind].format(name=target.name),
            gold=target.answer(kind), docs=tuple(c.document() for c in countries),
            candidates=tuple(c.answer(kind) for c in countries),
            answer_doc=countries.index(target)))
    return questions


def normalise(text: str) -> str:
    """Lower case, punctuation to spaces, articles dropped, whitespace collapsed."""
    text = text.lower().translate(str.maketrans(string.punctuation, " " * len(string.punctuation)))
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def _mentions(answer: str, phrase: str) -> bool:
    return re.search(rf"(^| ){re.escape(phrase)}( |$)", answer) is not None


def first_sentence(text: str) -> str:
    """The answer proper: a model that goes on after it ("Drennik. The flag...") is
    not judged on what follows."""
    return re.split(r"[.\n]", text, maxsplit=1)[0]


def answer_matches(answer: str, gold: str, candidates: tuple[str, ...] | list[str]) -> bool:
    """Exact match, normalised: the answer's first sentence names the gold answer and
    no other candidate.

    The gold must appear as whole words ("a white flag" matches "white"); naming
    a second candidate as well is a miss.
    """
    said = normalise(first_sentence(answer))
    if not _mentions(said, normalise(gold)):
        return False
    return not any(_mentions(said, normalise(c)) for c in candidates if c != gold)


_USER_SLOT = "\x00USER\x00"


def chat_parts(tokenizer, question: Question) -> tuple[str, list[str], str]:
    """(header, documents, task) texts whose concatenation is the plain chat prompt
    (the tokenizer's chat template, one user turn, the answer's first words after it)."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": _USER_SLOT}], tokenize=False, add_generation_prompt=True)
    before, after = rendered.split(_USER_SLOT)
    header = f"{before}{INSTRUCTION}\n\n"
    docs = [f"{doc}\n\n" for doc in question.docs]
    task = f"Question: {question.text}{after}{question.answer_prefix}"
    return header, docs, task


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of a part of the prompt (no BOS: the chat template has its own)."""
    return list(tokenizer.encode(text, add_special_tokens=False))
