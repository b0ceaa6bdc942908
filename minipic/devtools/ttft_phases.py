"""The TTFT measurement of tools/bench_ttft.py, as a library: stock vLLM vs minipic GPU hit vs
minipic from disk, each phase an engine in a process of its own (as a restart would give).
tools/bench_ttft.py's docstring says what the phases and their disk specs mean; tools/bench_rag.py
runs `measure()` for Figure 2's TTFT panel.

The parent (`measure`) builds the model and the token-id prompts once and writes them to a
file; each phase re-enters this module as `python -m minipic.devtools.ttft_phases --phase ...`,
which prints its result as one `RESULT {json}` line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from minipic.devtools.bench_setup import (BLOCK_SIZES, connector_extra, make_model, random_words,
                                         split_disk_phase)
from minipic.devtools import gc_pauses, step_phases
from minipic.devtools.page_cache import drop_from_page_cache
from minipic.devtools.request_stages import STAGES, request_stages
from minipic.devtools.stack_sampler import ENV_FOLDER, sample_window
from minipic.devtools.store_totals import store_totals
from minipic.devtools.timing import timed

# A point's timed series by key prefix, with what they are called: the prompt, stock's rerun
# of it (its own full prefix hit), stock on the same documents with a new question (its
# prefix hit when only the question is new).
SERIES = {"": "", "rerun_": "rerun", "newq_": "new question"}

# The store's counters that a disk phase's result reports (as `store_loads`).
LOAD_COUNTERS = ("load_jobs", "load_us", "hit_blocks", "hit_bytes")


def workload(arch: str, doc_counts: list[int], doc_tokens: int, repeats: int, block_size: int,
             markers: dict, prompt_sets: list[str], recipe: str = "block_attention") -> dict:
    """Token-id prompts: span prefills and final prompts (the recipe's layout).

    Every timed prompt (each document count, each repeat) has documents of its own, used by no
    other timed prompt of the phase: in the disk-warm phase each prompt then really loads its
    documents from the store, instead of hitting copies an earlier prompt already loaded into
    GPU memory. The phases share the document sets (the spans come from the gpu-hit phase) and
    differ in the question and the document order.
    """
    from minipic.client.prompts.recipes import RECIPES_BY_NAME
    from minipic.protocol import SpanProtocol

    build = RECIPES_BY_NAME[recipe]
    rng = random.Random(0)
    words = random_words(rng, arch)
    protocol = SpanProtocol.from_dict(markers)
    system = words(64)
    doc_sets = [(k, [words(doc_tokens) for _ in range(k)]) for k in doc_counts
                for _ in range(repeats)]
    warm_docs = [words(doc_tokens) for _ in range(max(doc_counts))]
    make = lambda docs: build(rng.sample(docs, len(docs)), words(32), system=system,
                              protocol=protocol, block_size=block_size)
    finals = {name: [[k, make(docs).final] for k, docs in doc_sets] for name in prompt_sets}
    # Warm-up: the same kinds of steps on other documents (their spans are stored too, so the
    # disk-warm phase also warms its load path), so first-launch costs stay out of the timing.
    warmups = {name: [make(warm_docs[:k]).final for k in doc_counts for _ in range(2)]
               for name in prompt_sets}
    # One more prompt per phase, on fresh documents, for --profile-dir (not timed).
    profile_docs = [words(doc_tokens) for _ in range(max(doc_counts))]
    profiled = {name: make(profile_docs).final for name in prompt_sets}
    every_doc = [doc for _, docs in doc_sets for doc in docs] + warm_docs + profile_docs
    # Stock's prefix hit with a question of its own (the hit's work: its question), drawn
    # apart so that the prompts above stay what they were.
    new_words = random_words(random.Random(1), arch)
    new_questions = [[k, with_new_question(final, protocol.pdep_token_id, new_words)]
                     for k, final in finals.get("stock", [])]
    if "stock" in warmups:
        warmups["stock"] = with_hit_warmups(warmups["stock"], protocol.pdep_token_id, new_words)
    return {"prefills": make(every_doc).span_prefills, "finals": finals, "warmups": warmups,
            "profiled": profiled, "new_questions": new_questions}


def with_hit_warmups(warmups: list[list[int]], pdep: int, words) -> list[list[int]]:
    """Stock's warm-up prompts, each followed by its rerun and by itself with a new question:
    stock's timed prompts are each followed by those two prefix hits, and the first hit of
    each kind ran a step no warm-up had (eager: 150 ms against 52 for the second rerun at
    40 documents, b223ba4, where compiled reruns replay a graph captured at start-up and
    showed no such first)."""
    return [prompt for final in warmups
            for prompt in (final, final, with_new_question(final, pdep, words))]


def with_new_question(final: list[int], pdep: int, words) -> list[int]:
    """`final` with what follows its last PDep marker drawn anew: the same documents in the
    same order and another question, so stock's prefix cache holds all but the question
    (its rerun of `final` itself computes one token, which vLLM runs as a decode step)."""
    start = len(final) - 1 - final[::-1].index(pdep)
    return final[: start + 1] + words(len(final) - start - 1)


def final_prompt_tokens(doc_counts: list[int], doc_tokens: int, block_size: int) -> int:
    """The longest final prompt: system 64 + padded SSep documents + PDep question 32."""
    span = -(-(doc_tokens + 1) // block_size) * block_size
    return 64 + max(doc_counts) * span + 32


@dataclasses.dataclass(frozen=True)
class Phase:
    """One engine process of the benchmark."""

    name: str
    prompts: str  # its prompt set: the same documents in every set, its own questions and order
    minipic: bool = True
    read_threads: int | None = None  # disk phases: the disk tier's read threads
    read_processes: int | None = None  # and its reader processes (None: minipic's default)
    cold: bool = False  # drop the store's files from the page cache first
    paired: bool = False  # stock and gpu-hit in one process, their prompts taking turns

    @classmethod
    def disk(cls, spec: str, index: int = 0) -> "Phase":
        """`warm:4`, `cold:16`, `warm:16:0` (see tools/bench_ttft.py's docstring). Each disk
        phase has its own questions, so none hits a question block an earlier one stored."""
        kind, threads, processes = split_disk_phase(spec)
        name = f"disk-{kind}-t{threads}" + "".join(f"-p{p}" for p in processes)
        return cls(name=name, prompts=f"disk-{index}", read_threads=int(threads),
                   read_processes=int(processes[0]) if processes else None,
                   cold=kind == "cold")


def phases_of(disk_specs: list[str], paired: bool = False) -> list[Phase]:
    first = [Phase("paired", "gpu-hit", paired=True)] if paired else [
        Phase("stock", "stock", minipic=False), Phase("gpu-hit", "gpu-hit")]
    return [*first, *(Phase.disk(spec, i) for i, spec in enumerate(disk_specs))]


def start_engine(phase: Phase, model: str, engine: dict, connector: dict,
                 profile_dir: str | None = None, profile_stack: bool = False):
    """`phase`'s engine in this process, and its `run(prompts)` (one token each, greedy),
    warmed up on one prompt so that kernels are compiled or loaded before any timing."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from minipic.config import connector_config

    # stats on: each output's engine timestamps split its TTFT (request_stages.py)
    kwargs = dict(engine, model=model, enable_prefix_caching=True, seed=0,
                  disable_log_stats=False)
    if profile_dir:
        kwargs["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": profile_dir,
                                     "torch_profiler_with_stack": profile_stack}
    if phase.minipic:
        extra = dict(connector)
        if phase.read_threads:
            extra["disk_read_threads"] = phase.read_threads
        if phase.read_processes is not None:
            extra["disk_read_processes"] = phase.read_processes
        kwargs["kv_transfer_config"] = connector_config(extra)
    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    run = lambda prompts: llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                       params, use_tqdm=False)
    run([[11] * 64])
    return llm, run


def run_phase(phase: dict, model: str, engine: dict, connector: dict, load: dict,
              profile_dir: str | None = None, profile_stack: bool = False,
              host_profile_dir: str | None = None) -> dict:
    """In this process: start one engine, time the final prompts."""
    from minipic.devtools.host_profile import host_profile, run_engine_core_here

    assert not (profile_dir and host_profile_dir), "the torch profiler or cProfile, not both"
    if host_profile_dir:  # cProfile sees the engine core only in this process
        run_engine_core_here()
    phase = Phase(**phase)
    if phase.paired:
        from minipic.devtools.ttft_paired import run_paired

        return {"phase": phase.name, "phases": run_paired(model, engine, connector, load)}
    llm, run = start_engine(phase, model, engine, connector, profile_dir, profile_stack)
    if phase.prompts == "gpu-hit":
        check_gpu_holds(llm, load, engine["block_size"])
    warm_up(run, load, phase.prompts, connector)
    points: dict[int, dict] = {}
    new_questions = load["new_questions"] if not phase.minipic else None
    for i, (docs, final) in enumerate(load["finals"][phase.prompts]):
        time_final(points, phase.name, run, docs, final, rerun=not phase.minipic,
                   new_question=new_questions[i][1] if new_questions else None)
    if profile_dir or host_profile_dir:  # one more max-size prompt on fresh documents
        profiled = load["profiled"][phase.prompts]
        if not phase.minipic:  # stock: its own full prefix hit, the floor a hit is held to
            run([profiled])
        if profile_dir:  # under the torch profiler
            llm.start_profile(profile_prefix=phase.name)
            run([profiled])
            llm.stop_profile()
        else:
            with host_profile(Path(host_profile_dir) / f"{phase.name}.txt",
                              f"{phase.name}: one prompt of {len(profiled)} tokens"):
                run([profiled])
    llm.llm_engine.engine_core.shutdown()  # the disk tier finishes its writes
    return phase_result(phase.name, points, in_process=bool(host_profile_dir))


class GpuTooSmallError(RuntimeError):
    """The gpu-hit engine's KV cache cannot hold the documents its timed prompts hit."""


def gpu_blocks_needed(load: dict, block_size: int) -> int:
    """KV blocks the gpu-hit engine holds at once: every prefilled span and a final prompt."""
    blocks = lambda tokens: -(-len(tokens) // block_size)
    longest = max((final for finals in load["finals"].values() for _, final in finals), key=len)
    return sum(map(blocks, load["prefills"])) + blocks(longest)


def check_gpu_holds(llm, load: dict, block_size: int) -> None:
    """Refuse a gpu-hit phase whose KV cache cannot hold every prefilled span at once: its
    timed prompts would load evicted documents back from the CPU tier and be timed as GPU
    hits (a paired run on half the GPU took 185 ms where the documents fit took 50)."""
    needed = gpu_blocks_needed(load, block_size)
    held = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks or 0
    if held < needed:
        raise GpuTooSmallError(
            f"the gpu-hit engine's KV cache holds {held} blocks of {block_size} tokens; its "
            f"prompts' documents need {needed}: time fewer --repeats or one --docs count at "
            f"a time")


def warm_up(run, load: dict, prompts: str, connector: dict) -> None:
    """Before timing: the gpu-hit set's span prefills (and their traffic over), then the
    set's warm-up prompts (the same kinds of steps on other documents)."""
    from minipic.connector.store.settle import wait_until_settled

    if prompts == "gpu-hit":
        run(load["prefills"])
        # Their blocks stream to the CPU tier and the store for seconds after the prefills:
        # time the hits once that traffic is over, not against it.
        wait_until_settled(connector["store_dir"], quiet_s=2.0)
    for final in load["warmups"][prompts]:
        run([final])


def time_final(points: dict[int, dict], name: str, run, docs: int, final: list[int],
               rerun: bool, new_question: list[int] | None = None) -> None:
    """One timed final prompt into points[docs]; `rerun`: then the same prompt again, stock's
    own full prefix-cache hit (as `rerun_ttft_s`); `new_question`: then that prompt, the
    same documents with another question (as `newq_ttft_s`, its cached tokens too)."""
    point = points.setdefault(docs, {"docs": docs, "ttft_s": [], "cached_tokens": [],
                                     "prompt_tokens": len(final)})
    out = _time_one(point, "", f"{name} docs={docs}", run, final)
    point["cached_tokens"].append(out.num_cached_tokens)
    if rerun:
        _time_one(point, "rerun_", f"stock-rerun docs={docs}", run, final)
    if new_question is not None:
        out = _time_one(point, "newq_", f"stock-new-question docs={docs}", run, new_question)
        point.setdefault("newq_cached_tokens", []).append(out.num_cached_tokens)


def _time_one(point: dict, series: str, window: str, run, final: list[int]):
    """One request timed into point[series + "ttft_s"], its stages (request_stages.py) into
    point[series + "stages_s"]; returns its output."""
    # max_tokens=1: the seconds to the answer are the seconds to its first token.
    with sample_window(window):
        begin = time.monotonic()
        ttft, [out] = timed(run, [final])
        end = time.monotonic()
    point.setdefault(f"{series}ttft_s", []).append(ttft)
    point.setdefault(f"{series}windows_s", []).append((begin, end))
    point.setdefault(f"{series}stages_s", []).append(request_stages(begin, end, out.metrics))
    return out


def phase_result(name: str, points: dict[int, dict], **tags) -> dict:
    """A phase's points with their medians. An in-process engine (--host-profile) is timed
    too, but not as a benchmark's is; nor is one whose timed requests were stack-sampled:
    the tags say so."""
    folder = os.environ.get(gc_pauses.ENV_FOLDER)
    pauses = gc_pauses.read_pauses(Path(folder)) if folder else None
    folder = os.environ.get(step_phases.ENV_FOLDER)
    calls = step_phases.read_phases(Path(folder)) if folder else None
    for point in points.values():
        for series in SERIES:
            if f"{series}ttft_s" in point:
                point[f"median_{series}ttft_s"] = statistics.median(point[f"{series}ttft_s"])
                point[f"median_{series}stages_s"] = median_stages(point[f"{series}stages_s"])
                if pauses is not None:  # collections inside each timed request
                    point[f"{series}gc_pause_s"] = [gc_pauses.pauses_within(pauses, *w)
                                                    for w in point[f"{series}windows_s"]]
                if calls is not None:  # host functions' seconds inside each timed request
                    point[f"{series}phases_s"] = [step_phases.phases_within(calls, *w)
                                                  for w in point[f"{series}windows_s"]]
    return {"phase": name, "points": list(points.values()), "in_process": False,
            "stack_sampled": bool(os.environ.get(ENV_FOLDER)), **tags}


def median_stages(stages: list[dict | None]) -> dict[str, float] | None:
    """Each stage's median over the requests that have all of them (None if one has not)."""
    if not stages or None in stages:
        return None
    return {stage: statistics.median(s[stage] for s in stages) for stage in STAGES}


def measure(arch: str, doc_counts: list[int], doc_tokens: int, repeats: int, eager: bool,
            save=lambda results: None, profile_dir: Path | None = None,
            disk_phases: list[str] = ("warm:4",), cpu_bytes: int | None = None,
            recipe: str = "block_attention", minipic_options: dict | None = None,
            profile_stack: bool = False, host_profile_dir: Path | None = None,
            paired: bool = False) -> list[dict]:
    """All phases, each in its own process; `save(results)` after each (a late failure keeps
    the earlier phases). Returns one dict per phase, {"phase", "points"} or {"phase", "error"}.
    `paired`: stock and gpu-hit run in one process, prompt by prompt (ttft_paired.py)."""
    with tempfile.TemporaryDirectory() as tmp:
        block_size = BLOCK_SIZES[arch]
        needed = final_prompt_tokens(doc_counts, doc_tokens, block_size) + 64
        # EPIC's links: up to 64 tokens a document (epic64), or two blocks (epic2)
        needed += max(64, 2 * block_size) * max(doc_counts)
        model, engine, markers = make_model(arch, Path(tmp), max_model_len=needed)
        engine["enforce_eager"] = engine.get("enforce_eager", False) or eager
        phases = phases_of(list(disk_phases), paired)
        load = workload(arch, doc_counts, doc_tokens, repeats, engine["block_size"], markers,
                        [phase.prompts for phase in phases] + ["stock"] * paired, recipe)
        child = Path(tmp) / "child.json"  # token lists: too long for a command line
        store = f"{tmp}/store"
        child.write_text(json.dumps(dict(model=model, engine=engine, load=load,
                                         connector={**connector_extra(arch, store, markers,
                                                                      cpu_bytes),
                                                    **(minipic_options or {})},
                                         profile_dir=profile_dir and str(profile_dir),
                                         profile_stack=profile_stack,
                                         host_profile_dir=host_profile_dir
                                         and str(host_profile_dir))))
        results = []
        for phase in phases:
            if phase.cold:
                drop_from_page_cache(store)
            before = load_counters(store) if phase.read_threads else None
            result = run_child(phase, child)
            if before is not None:
                after = load_counters(store)
                result["store_loads"] = {k: after[k] - before[k] for k in after}
            results.extend(result.get("phases", [result]))  # a paired phase holds two
            save(results)
    return results


def load_counters(store: str) -> dict[str, int]:
    """The store's summed disk-load counters (all processes so far)."""
    totals = store_totals(store)
    return {k: totals[k] for k in LOAD_COUNTERS}


def run_child(phase: Phase, child: Path) -> dict:
    """One phase in a process of its own: this module again, importing minipic from where this
    process did (a checkout on sys.path alone is not inherited)."""
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "PYTHONPATH": os.pathsep.join(
        p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", __name__, "--phase", json.dumps(dataclasses.asdict(phase)),
           "--child-args", str(child)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        # the whole log: an engine's root cause (an OOM in its core) lies far above the end
        print(f"phase {phase.name} failed:\n{proc.stderr}", file=sys.stderr)
        return {"phase": phase.name, "error": proc.stderr[-3000:]}
    return json.loads(lines[-1][len("RESULT "):])


def child_main() -> None:
    """A phase's process (started by run_child): its result as one RESULT line."""
    parser = argparse.ArgumentParser(description="one phase of minipic.devtools.ttft_phases")
    parser.add_argument("--phase", type=json.loads, required=True)
    parser.add_argument("--child-args", type=Path, required=True)
    args = parser.parse_args()
    child = json.loads(args.child_args.read_text())
    print("RESULT " + json.dumps(run_phase(args.phase, **child)), flush=True)


if __name__ == "__main__":
    child_main()
