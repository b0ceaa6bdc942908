"""TTFT of a RAG final prompt: stock vLLM vs minipic GPU hit vs minipic disk-warm after a restart.

    # H200, vLLM 0.25.1 bundle, Llama-3-8B shape with dummy weights:
    .bundle/run_with_bundle.sh .bundle/vllm-0.25.1-sm90.tar.xz \\
        python3 tools/bench_ttft.py --arch llama3-8b --docs 10 --doc-tokens 1000 --out $OUT/ttft.json
    # CPU smoke run on the tiny random model (numbers are not the product's):
    python tools/bench_ttft.py --arch tiny --docs 4 --doc-tokens 200
    # TTFT vs number of cached documents (Figure 2, right), one engine per phase for all counts:
    python3 tools/bench_ttft.py --docs 1,2,5,10,20,40 --doc-tokens 1000 --out $OUT/ttft.json

Each phase runs in its own process, as a restart would:
  1. stock: vLLM without minipic; every final prompt is prefilled in full (its documents follow
     the system prompt in a new order, so the prefix cache only reuses the system prompt). Each
     prompt is then sent once more: that second TTFT is stock vLLM's own full prefix-cache hit
     on the same prompt, the floor a hit can reach ("stock rerun");
  2. gpu-hit: minipic with MiniPICConnector on a fresh store; spans prefilled once, then the
     final prompts hit them in GPU memory;
  3. disk phases (`--disk-phases`, default `warm:4`): each a new process on the same store, all
     on the same documents (each with its own questions); the spans come from the disk tier.
     `warm:T` reads with T threads, the store's files still in the OS page cache (written
     minutes earlier, as after a restart on the same host); `cold:T` first drops the store's
     files from the page cache (posix_fadvise DONTNEED), so they come from the device;
     `warm:T:P` also sets the reader processes (`disk_read_processes`, 0 = threads only).
TTFT = wall time of one request with max_tokens=1, requests one at a time, median of --repeats
prompts. Every timed prompt has documents no other timed prompt of its phase uses, so a
disk-phase prompt loads all its documents from the store (an earlier version reused one pool,
and after the first prompt the disk-warm phase measured GPU hits). The gpu-hit phase prefills
and keeps sum(--docs) x --repeats documents, plus twice max(--docs) (warm-up and profiled).
After each disk phase the store's load counters (files -> CPU tier per request, see
`minipic store stats`) are added to its result. All phases run in one invocation. `--cpu-gb`
sizes the connector's CPU tier (8 GiB on the 8B model by default): a prompt's loads pass through
it, so 40 documents of 1000 tokens (5 GiB) want more.
`measure()` is the same run as a function (tools/bench_rag.py uses it for Figure 2).
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from minipic.devtools.bench_setup import (  # noqa: E402  (shared with tools/bench_rag.py)
    DEFAULT_DISK_PHASES, connector_extra, disk_phase_list, gib, int_list, make_model, random_words,
    split_disk_phase)


def workload(arch: str, doc_counts: list[int], doc_tokens: int, repeats: int, block_size: int,
             markers: dict, prompt_sets: list[str], recipe: str = "block_attention") -> dict:
    """Token-id prompts: span prefills and final prompts (the recipe's layout).

    Every timed prompt (each document count, each repeat) has documents of its own, used by no
    other timed prompt of the phase: in the disk-warm phase each prompt then really loads its
    documents from the store, instead of hitting copies an earlier prompt already loaded into
    GPU memory. The phases share the document sets (the spans come from the gpu-hit phase) and
    differ in the question and the document order.
    """
    from minipic.client import block_attention, epic
    from minipic.protocol import SpanProtocol

    build = {"block_attention": block_attention, "epic": epic}[recipe]
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
    return {"prefills": make(every_doc).span_prefills, "finals": finals, "warmups": warmups,
            "profiled": profiled}


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

    @classmethod
    def disk(cls, spec: str, index: int = 0) -> "Phase":
        """`warm:4`, `cold:16`, `warm:16:0` (see the module docstring). Each disk phase has
        its own questions, so none hits a question block an earlier one stored."""
        kind, threads, processes = split_disk_phase(spec)
        name = f"disk-{kind}-t{threads}" + "".join(f"-p{p}" for p in processes)
        return cls(name=name, prompts=f"disk-{index}", read_threads=int(threads),
                   read_processes=int(processes[0]) if processes else None,
                   cold=kind == "cold")


def phases_of(disk_specs: list[str]) -> list[Phase]:
    return [Phase("stock", "stock", minipic=False), Phase("gpu-hit", "gpu-hit"),
            *(Phase.disk(spec, i) for i, spec in enumerate(disk_specs))]


def run_phase(phase: dict, model: str, engine: dict, connector: dict, load: dict,
              profile_dir: str | None = None) -> dict:
    """In this process: start one engine, time the final prompts."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from minipic.config import connector_config
    from minipic.connector.store.settle import wait_until_settled

    phase = Phase(**phase)
    kwargs = dict(engine, model=model, enable_prefix_caching=True, seed=0)
    if profile_dir:
        kwargs["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": profile_dir,
                                     "torch_profiler_with_stack": False}
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
    run([[11] * 64])  # kernels compiled/loaded before timing
    if phase.prompts == "gpu-hit":
        run(load["prefills"])
        # Their blocks stream to the CPU tier and the store for seconds after the prefills:
        # time the hits once that traffic is over, not against it.
        wait_until_settled(connector["store_dir"], quiet_s=2.0)
    for final in load["warmups"][phase.prompts]:
        run([final])
    points: dict[int, dict] = {}
    for docs, final in load["finals"][phase.prompts]:
        point = points.setdefault(docs, {"docs": docs, "ttft_s": [], "cached_tokens": [],
                                         "prompt_tokens": len(final)})
        ttft, out = timed(run, final)
        point["ttft_s"].append(ttft)
        point["cached_tokens"].append(out.num_cached_tokens)
        if not phase.minipic:  # the same prompt again: stock's own full prefix-cache hit
            point.setdefault("rerun_ttft_s", []).append(timed(run, final)[0])
    if profile_dir:  # one more max-size prompt on fresh documents, under the torch profiler
        llm.start_profile(profile_prefix=phase.name)
        run([load["profiled"][phase.prompts]])
        llm.stop_profile()
    llm.llm_engine.engine_core.shutdown()  # the disk tier finishes its writes
    for point in points.values():
        for series in ("ttft_s", "rerun_ttft_s"):
            if series in point:
                point[f"median_{series}"] = statistics.median(point[series])
    return {"phase": phase.name, "points": list(points.values())}


def timed(run, prompt) -> tuple[float, object]:
    """Seconds to the answer of one prompt (max_tokens=1: its first token), and the answer."""
    start = time.perf_counter()
    [out] = run([prompt])
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", choices=["llama3-8b", "tiny"], default="llama3-8b")
    parser.add_argument("--docs", type=int_list, default=[10],
                        help="documents per final prompt; a list (1,2,5,10) measures each")
    parser.add_argument("--doc-tokens", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--eager", action="store_true",
                        help="enforce_eager (faster start; TTFT of long prefills barely changes)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--profile-dir", type=Path,
                        help="also run one untimed prompt per phase (fresh documents, the "
                             "largest count) under vLLM's torch profiler; traces go here")
    parser.add_argument("--cpu-gb", type=float, help="the connector's CPU tier (default 8 on 8B)")
    parser.add_argument("--disk-phases", type=disk_phase_list, default=DEFAULT_DISK_PHASES,
                        help="disk phases, e.g. warm:4,warm:16,cold:16 (module docstring)")
    parser.add_argument("--recipe", choices=["block_attention", "epic"], default="block_attention",
                        help="span prompt layout (EPIC recomputes one link block per document)")
    parser.add_argument("--phase", type=json.loads, help=argparse.SUPPRESS)  # child entry
    parser.add_argument("--child-args", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        child = json.loads(args.child_args.read_text())
        print("RESULT " + json.dumps(run_phase(args.phase, **child)), flush=True)
        return
    results = measure(args.arch, args.docs, args.doc_tokens, args.repeats, args.eager,
                      save=lambda results: save(results, args), profile_dir=args.profile_dir,
                      disk_phases=args.disk_phases, cpu_bytes=gib(args.cpu_gb),
                      recipe=args.recipe)
    report(results, args)


def measure(arch: str, doc_counts: list[int], doc_tokens: int, repeats: int, eager: bool,
            save=lambda results: None, profile_dir: Path | None = None,
            disk_phases: list[str] = ("warm:4",), cpu_bytes: int | None = None,
            recipe: str = "block_attention") -> list[dict]:
    """All phases, each in its own process; `save(results)` after each (a late failure keeps
    the earlier phases). Returns one dict per phase, {"phase", "points"} or {"phase", "error"}."""
    with tempfile.TemporaryDirectory() as tmp:
        model, engine, markers = make_model(arch, Path(tmp))
        needed = final_prompt_tokens(doc_counts, doc_tokens, engine["block_size"]) + 64
        needed += max(doc_counts) * engine["block_size"]  # EPIC's link blocks
        engine["max_model_len"] = max(engine["max_model_len"], needed)
        engine["enforce_eager"] = engine.get("enforce_eager", False) or eager
        phases = phases_of(list(disk_phases))
        load = workload(arch, doc_counts, doc_tokens, repeats, engine["block_size"], markers,
                        [phase.prompts for phase in phases], recipe)
        child = Path(tmp) / "child.json"  # token lists: too long for a command line
        store = f"{tmp}/store"
        child.write_text(json.dumps(dict(model=model, engine=engine, load=load,
                                         connector=connector_extra(arch, store, markers, cpu_bytes),
                                         profile_dir=profile_dir and str(profile_dir))))
        results = []
        for phase in phases:
            if phase.cold:
                drop_from_page_cache(store)
            before = load_counters(store) if phase.read_threads else None
            result = run_child(phase, child)
            if before is not None:
                after = load_counters(store)
                result["store_loads"] = {k: after[k] - before[k] for k in after}
            results.append(result)
            save(results)
    return results


def drop_from_page_cache(store: str) -> int:
    """Make the next reads of the store's files come from the device (needs no privileges:
    clean pages of a file are dropped on request). Returns the number of files."""
    os.sync()  # dirty pages cannot be dropped
    count = 0
    for root, _, files in os.walk(store):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            count += 1
    return count


def load_counters(store: str) -> dict[str, int]:
    """The store's summed disk-load counters (all processes so far)."""
    from minipic.connector.store.stats import scan_store

    totals = dict.fromkeys(("load_jobs", "load_us", "hit_blocks", "hit_bytes"), 0)
    if os.path.isdir(store):
        for ns in scan_store(store):
            for k in totals:
                totals[k] += ns.counters[k]
    return totals


def run_child(phase: Phase, child: Path) -> dict:
    cmd = [sys.executable, __file__, "--phase", json.dumps(dataclasses.asdict(phase)),
           "--child-args", str(child)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        print(f"phase {phase.name} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
        return {"phase": phase.name, "error": proc.stderr[-3000:]}
    return json.loads(lines[-1][len("RESULT "):])


def save(results: list[dict], args) -> None:
    if args.out:
        options = {k: v for k, v in vars(args).items() if k not in ("out", "phase", "child_args")}
        args.out.write_text(json.dumps({"args": options, "results": results}, indent=1,
                                       default=str))


def report(results: list[dict], args) -> None:
    by_phase = {r["phase"]: r for r in results if "error" not in r}
    failed = [r["phase"] for r in results if "error" in r]
    if failed or "stock" not in by_phase:
        sys.exit(f"phases that failed: {failed}")
    for i, docs in enumerate(args.docs):
        point = {phase: r["points"][i] for phase, r in by_phase.items()}
        stock = point["stock"]["median_ttft_s"]
        print(f"{docs} documents x {args.doc_tokens} tokens, {args.arch}, "
              f"median of {args.repeats} final prompts")
        print("| phase | median TTFT (ms) | cached tokens / prompt tokens | speed-up vs stock |")
        print("| --- | --- | --- | --- |")
        rows = [(phase, p["median_ttft_s"], p) for phase, p in point.items()]
        rows.insert(1, ("stock rerun (full prefix hit)", point["stock"]["median_rerun_ttft_s"],
                        None))
        for name, ttft, p in rows:
            cached = f"{min(p['cached_tokens'])}-{max(p['cached_tokens'])} / {p['prompt_tokens']}" \
                if p else "-"
            print(f"| {name} | {ttft * 1e3:.1f} | {cached} | {stock / ttft:.1f}x |")
        hit = point["gpu-hit"]["median_ttft_s"]
        for name, p in point.items():
            if name.startswith("disk"):
                disk = p["median_ttft_s"]
                print(f"{name}: / gpu-hit = {disk / hit:.2f} (goal <= 3); stock / {name} = "
                      f"{stock / disk:.1f} (goal >= 10)")
    for r in results:
        loads = r.get("store_loads")
        if loads and loads["load_jobs"]:
            seconds = loads["load_us"] / 1e6
            print(f"{r['phase']}: {loads['load_jobs']} disk loads (warm-ups included), "
                  f"{seconds / loads['load_jobs'] * 1e3:.1f} ms each, "
                  f"{loads['hit_bytes'] / seconds / 2**30:.2f} GiB/s files -> CPU tier")


if __name__ == "__main__":
    main()
