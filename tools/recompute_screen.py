"""Screen which document blocks to recompute in context (HF reference, no vLLM).

EPIC recomputes the first blocks of every document in context and reuses the rest. This tool
asks, on the real SmolLM2-135M-Instruct, whether another choice of blocks keeps answers closer
to stock for its share of recomputed document tokens (reported with each variant): blocks
picked by their words' overlap with the question, the whole answer document, a middle or last
block, and whether softening the task's attention to solo-computed keys (APE's temperature and
scale) helps.

The layout is built here from the rules, independently of minipic's SpanLayout (and checked
against it: tests/tools/test_recompute_screen.py): every document a span computed alone with
its SSep marker as its sink; each chosen block computed again in context at the document's
logical positions, seeing the header, every earlier document (chosen blocks in their
recomputed form) and itself; the task seeing the same. Markers take no room, as minipic's
`mask_markers` gives (docs/accuracy.md).

Scored per question against stock's plain causal prompt: KL(stock || variant) of the first
answer token over the whole vocabulary, the gold answer's log-likelihood, and whether the
first / every gold token is the argmax. A screen for recipe ideas: accuracy claims come from
tools/bench_accuracy.py on a real engine.

Variant names: `stock`, or rules joined by `+`, then optionally `@TxS`:
  none          no block recomputed (Block-Attention)
  first:K       the first K blocks of every document (EPIC)
  block:C       block C of every document (0 is the one holding the marker)
  last          the last block of every document
  answer_doc    every block of the document holding the answer (an oracle: no client knows it)
  lexical:K     the K blocks, over all documents, whose words overlap the question's most
                (idf-weighted, as a retriever would rank them; here the question names its
                country, so these are the answer document's blocks)
  head:T        the first T body tokens of every document (EPIC at any granularity)
  deviation:P   the P% of all document tokens whose hidden state entering layer 1 deviates
                most between computed alone and the full prefill (CacheBlend's signal, here
                an oracle); single tokens, not blocks
  @TxS          task and link queries attending solo-computed keys: logits / T + log S
                (first:1@1.25x1: T 1.25, S 1)

    python tools/recompute_screen.py --questions 60 --variants stock,first:1,lexical:2,none
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from accuracy_variants import additive_mask, gold_tokens  # noqa: E402
from minipic.devtools.smollm2 import smollm2_model_dir  # noqa: E402
from minipic.devtools.synthetic_qa import chat_parts, encode, make_questions  # noqa: E402

MARKER = 3  # SmolLM2's SSep marker (smollm2_protocol); hidden from all but its own span


@dataclass
class Layout:
    tokens: list[int]
    allowed: torch.Tensor  # [n, n] bool
    positions: torch.Tensor  # [n]
    scaled: torch.Tensor  # [n, n] bool: (context query, solo-computed key) pairs


@dataclass
class Documents:
    """One question's parts as token ids, and its documents' blocks as spans hold them
    (block 0 starts with the SSep marker, so it holds block_size - 1 body tokens)."""
    header: list[int]
    bodies: list[list[int]]
    task: list[int]
    block_size: int

    def blocks(self, doc: int) -> int:
        return -(-(len(self.bodies[doc]) + 1) // self.block_size)

    def body_range(self, doc: int, block: int) -> range:
        b = self.block_size
        return range(max(0, block * b - 1), min(len(self.bodies[doc]), (block + 1) * b - 1))

    def block_tokens(self, doc: int, block: int) -> set[tuple[int, int]]:
        """Block `block` of document `doc` as (document, body index) tokens."""
        return {(doc, j) for j in self.body_range(doc, block)}

    def recomputed_fraction(self, chosen: set[tuple[int, int]]) -> float:
        """The share of document body tokens that `chosen` recomputes."""
        return len(chosen) / sum(len(body) for body in self.bodies)


def build_layout(docs: Documents, chosen: set[tuple[int, int]]) -> Layout:
    """[header][SSep d0]...[SSep dN][chosen tokens, in order][task]: the sequence minipic
    computes, with the attention and logical positions its rules give (module docstring).
    `chosen`: (document, body index) of every recomputed token; minipic recomputes whole
    blocks, the screen also single tokens (rules head and deviation)."""
    starts, position = [], len(docs.header)
    for body in docs.bodies:
        starts.append(position)
        position += len(body)
    # (role, document, body index, token, logical position)
    items = [("header", -1, -1, t, j) for j, t in enumerate(docs.header)]
    for i, body in enumerate(docs.bodies):
        items.append(("marker", i, -1, MARKER, starts[i] - 1))
        items += [("span", i, j, t, starts[i] + j) for j, t in enumerate(body)]
    items += [("link", i, j, docs.bodies[i][j], starts[i] + j) for i, j in sorted(chosen)]
    items += [("task", -1, -1, t, position + j) for j, t in enumerate(docs.task)]
    role = [it[0] for it in items]

    def where(*names: str) -> torch.Tensor:
        return torch.tensor([r in names for r in role])

    doc = torch.tensor([it[1] for it in items])
    logical = torch.tensor([it[4] for it in items])
    replaced = torch.tensor([r == "span" and (it[1], it[2]) in chosen
                             for r, it in zip(role, items)])
    n = len(items)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    header, solo, context = where("header"), where("marker", "span"), where("link", "task")
    allowed = header[:, None] & header[None, :] & causal
    allowed |= solo[:, None] & solo[None, :] & (doc[:, None] == doc[None, :]) & causal
    seen_by_context = header | (where("span") & ~replaced) | context
    allowed |= context[:, None] & seen_by_context[None, :] & (logical[None, :] <= logical[:, None]) \
        & (~context[None, :] | causal)
    scaled = context[:, None] & (where("span") & ~replaced)[None, :]
    return Layout([it[3] for it in items], allowed, logical, scaled)


def stock_layout(docs: Documents) -> Layout:
    tokens = docs.header + [t for b in docs.bodies for t in b] + docs.task
    n = len(tokens)
    return Layout(tokens, torch.ones(n, n, dtype=torch.bool).tril(), torch.arange(n),
                  torch.zeros(n, n, dtype=torch.bool))


_STOP_WORDS = set("the a an of is in was what which who year colour flag city country main".split())


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower()))


def lexical_blocks(tokenizer, question_text: str, docs: Documents, k: int) -> set:
    """The k blocks whose words overlap the question's most, idf-weighted over the blocks."""
    asked = _words(question_text) - _STOP_WORDS
    blocks = [(i, c, _words(tokenizer.decode([docs.bodies[i][j] for j in docs.body_range(i, c)])))
              for i in range(len(docs.bodies)) for c in range(docs.blocks(i))]
    frequency = {w: sum(w in words for _, _, words in blocks) for w in asked}
    idf = {w: math.log(len(blocks) / f) for w, f in frequency.items() if f}
    ranked = sorted(blocks, key=lambda b: -sum(idf.get(w, 0.0) for w in asked & b[2]))
    return {(i, c) for i, c, _ in ranked[:k]}


RULES = ("none", "first", "block", "last", "answer_doc", "lexical", "head", "deviation")
_COUNTED = ("first", "block", "lexical", "head", "deviation")  # rules that take a number


def check_variant(name: str) -> None:
    """Refuse a variant name the tool cannot read, before the model loads."""
    if name == "stock":
        return
    try:
        rules, _, _ = parse_variant(name)
        for rule in rules.split("+"):
            rule_name, _, arg = rule.partition(":")
            if rule_name not in RULES or (rule_name in _COUNTED and not arg.isdigit()):
                raise ValueError(rule)
    except ValueError as error:
        raise SystemExit(f"variant {name!r}: cannot read {error} (see --help)") from None


def chosen_tokens(rules: str, tokenizer, question, docs: Documents,
                  deviation=None) -> set[tuple[int, int]]:
    """The (document, body index) tokens a variant's rules (module docstring) recompute for
    one question; `deviation()` gives each body token's deviation (rule deviation)."""
    blocks: set[tuple[int, int]] = set()
    tokens: set[tuple[int, int]] = set()
    every = range(len(docs.bodies))
    for rule in rules.split("+"):
        name, _, arg = rule.partition(":")
        if name == "first":
            blocks |= {(i, c) for i in every for c in range(min(int(arg), docs.blocks(i)))}
        elif name == "block":
            blocks |= {(i, int(arg)) for i in every if int(arg) < docs.blocks(i)}
        elif name == "last":
            blocks |= {(i, docs.blocks(i) - 1) for i in every}
        elif name == "answer_doc":
            blocks |= {(question.answer_doc, c) for c in range(docs.blocks(question.answer_doc))}
        elif name == "lexical":
            blocks |= lexical_blocks(tokenizer, question.text, docs, int(arg))
        elif name == "head":
            tokens |= {(i, j) for i in every for j in range(min(int(arg), len(docs.bodies[i])))}
        elif name == "deviation":
            tokens |= most_deviating(deviation(), int(arg))
        elif name != "none":
            raise SystemExit(f"unknown rule {rule!r} (see --help)")
    return tokens.union(*(docs.block_tokens(i, c) for i, c in blocks))


def most_deviating(deviation: dict[tuple[int, int], float], percent: int) -> set:
    """The `percent`% of all document tokens that deviate most."""
    count = round(len(deviation) * percent / 100)
    return set(sorted(deviation, key=deviation.get, reverse=True)[:count])


@torch.no_grad()
def token_deviation(model, docs: Documents, layer: int = 1) -> dict[tuple[int, int], float]:
    """Per document body token, how far its hidden state entering `layer` computed alone is
    from the full prefill's (L2): CacheBlend's signal for which tokens to recompute (the KV
    of layer 0 depends on the token and its position only, so layer 1's input is the first
    that differs). An oracle here: it needs the full prefill the recipe avoids; CacheBlend
    computes it from one layer in context."""
    def states(layout: Layout) -> torch.Tensor:
        model.config._attn_implementation = "sdpa"  # a scaled variant may have run before
        out = model(torch.tensor([layout.tokens]), attention_mask=additive_mask(layout.allowed),
                    position_ids=layout.positions[None], output_hidden_states=True)
        return out.hidden_states[layer][0]

    full, alone = states(stock_layout(docs)), states(build_layout(docs, set()))
    deviation, stock_index, solo_index = {}, len(docs.header), len(docs.header)
    for i, body in enumerate(docs.bodies):
        solo_index += 1  # the span's marker
        for j in range(len(body)):
            deviation[(i, j)] = float((full[stock_index + j] - alone[solo_index + j]).norm())
        stock_index += len(body)
        solo_index += len(body)
    return deviation


# Attention scaling for `@TxS` variants (APE): set per forward, read by scaled_attention.
_scaling: dict = {"pairs": None, "temperature": 1.0, "scale": 1.0}


def scaled_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Plain attention, but (context query, solo key) logits / T + log S (transformers'
    attention-function interface; GQA heads repeated)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    logits = query @ key.transpose(-1, -2) * scaling
    pairs = _scaling["pairs"]
    logits = torch.where(pairs, logits / _scaling["temperature"] + math.log(_scaling["scale"]),
                         logits)
    out = (logits + attention_mask).softmax(-1) @ value
    return out.transpose(1, 2).contiguous(), None


@torch.no_grad()
def answer_logprobs(model, layout: Layout, gold: list[int], temperature=1.0, scale=1.0):
    """[len(gold), vocab] logprobs of each gold token, teacher-forced after the prompt (each
    sees what the prompt's last token sees, the gold tokens before it and itself)."""
    n, g = len(layout.tokens), len(gold)
    allowed = torch.zeros(n + g, n + g, dtype=torch.bool)
    allowed[:n, :n] = layout.allowed
    allowed[n:, :n] = layout.allowed[n - 1]
    allowed[n:, n:] = torch.ones(g, g, dtype=torch.bool).tril()
    pairs = torch.zeros(n + g, n + g, dtype=torch.bool)
    pairs[:n, :n] = layout.scaled
    pairs[n:, :n] = layout.scaled[n - 1]
    positions = torch.cat([layout.positions, layout.positions[-1] + 1 + torch.arange(g)])
    plain = temperature == 1.0 and scale == 1.0
    model.config._attn_implementation = "sdpa" if plain else "minipic_scaled"
    _scaling.update(pairs=pairs, temperature=temperature, scale=scale)
    logits = model(torch.tensor([layout.tokens + gold]), attention_mask=additive_mask(allowed),
                   position_ids=positions[None]).logits[0, n - 1: n + g - 1]
    return logits.log_softmax(-1)


def score(stock: torch.Tensor, variant: torch.Tensor, gold: list[int]) -> dict:
    picked = variant.argmax(-1).tolist()
    return {"kl": float((stock[0].exp() * (stock[0] - variant[0])).sum()),
            "gold_logprob": float(variant[torch.arange(len(gold)), torch.tensor(gold)].sum()),
            "first": picked[0] == gold[0], "greedy": picked == gold}


def parse_variant(name: str) -> tuple[str, float, float]:
    rules, _, scaling = name.partition("@")
    if not scaling:
        return rules, 1.0, 1.0
    temperature, scale = (float(x) for x in scaling.split("x"))
    return rules, temperature, scale


def summarise(records: dict[str, list[dict]]) -> dict:
    """Per variant: means, and the paired gold-logprob difference from stock ± 1.96 s.e."""
    stock = records.get("stock")
    out = {}
    for name, rows in records.items():
        n = len(rows)
        summary = {m: sum(float(r[m]) for r in rows) / n
                   for m in ("kl", "gold_logprob", "first", "greedy", "recomputed_fraction")}
        kl = [r["kl"] for r in rows]
        summary["kl_half_width"] = _half_width(kl)
        if stock is not None and name != "stock":
            diff = [r["gold_logprob"] - s["gold_logprob"] for r, s in zip(rows, stock)]
            summary["gold_logprob_vs_stock"] = sum(diff) / n
            summary["gold_logprob_vs_stock_half_width"] = _half_width(diff)
        out[name] = {k: round(v, 4) for k, v in summary.items()}
    return out


def _half_width(values: list[float]) -> float:
    n = len(values)
    if n < 2:
        return float("nan")
    mean = sum(values) / n
    return 1.96 * math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--questions", type=int, default=60)
    parser.add_argument("--skip", type=int, default=0,
                        help="start at this question (to tune on others than an evaluation's)")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--variants", default="stock,none,first:1,first:2,lexical:2")
    parser.add_argument("--out", type=Path, default=Path("recompute_screen.json"))
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    for name in variants:
        check_variant(name)
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    AttentionInterface.register("minipic_scaled", scaled_attention)
    model_dir = smollm2_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    records: dict[str, list[dict]] = {v: [] for v in variants}
    start = time.time()
    for done, question in enumerate(make_questions(args.skip + args.questions)[args.skip:], 1):
        header, texts, task = chat_parts(tokenizer, question)
        docs = Documents(encode(tokenizer, header), [encode(tokenizer, t) for t in texts],
                         encode(tokenizer, task), args.block_size)
        gold = gold_tokens(tokenizer, question)
        stock = answer_logprobs(model, stock_layout(docs), gold)
        deviation = functools.cache(lambda: token_deviation(model, docs))
        for name in variants:
            chosen: set = set()
            if name == "stock":
                logprobs = stock
            else:
                rules, temperature, scale = parse_variant(name)
                chosen = chosen_tokens(rules, tokenizer, question, docs, deviation)
                logprobs = answer_logprobs(model, build_layout(docs, chosen), gold,
                                           temperature, scale)
            records[name].append({"id": question.id, "kind": question.kind,
                                  "recomputed_fraction": docs.recomputed_fraction(chosen),
                                  **score(stock, logprobs, gold)})
        summary = summarise(records)
        print(f"[{done}/{args.questions}, {time.time() - start:.0f}s] "
              + json.dumps({v: (s["kl"], s["gold_logprob"]) for v, s in summary.items()}),
              flush=True)
        args.out.write_text(json.dumps({"summary": summary, "questions": done, "skip": args.skip,
                                        "block_size": args.block_size,
                                        "command": " ".join(sys.argv), "records": records},
                                       indent=1))


if __name__ == "__main__":
    main()
