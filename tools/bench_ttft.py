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
     on the same prompt, the floor a hit can reach ("stock rerun"), where stock computes one
     token (the prompt's last); then the same documents with a new question, stock's prefix
     hit computing the question as minipic's hit does ("stock, new question");
  2. gpu-hit: minipic with MiniPICConnector on a fresh store; spans prefilled once, then the
     final prompts hit them in GPU memory;
  3. disk phases (`--disk-phases`, default `warm:4`): each a new process on the same store, all
     on the same documents (each with its own questions); the spans come from the disk tier.
     `warm:T` reads with T threads, the store's files still in the OS page cache (written
     minutes earlier, as after a restart on the same host); `cold:T` first drops the store's
     files from the page cache (posix_fadvise DONTNEED), so they come from the device;
     `warm:T:P` also sets the reader processes (`disk_read_processes`, 0 = threads only).
`--paired` runs phases 1 and 2 in one process instead, both engines up (stock's KV cache
holds max_model_len tokens, minipic gets the rest of the share) and their timed prompts
taking turns, so the host's drift weighs on both alike. TTFT = wall time of one request with max_tokens=1, requests one at a
time, median of --repeats prompts, split into stages by vLLM's request timestamps
(minipic.devtools.request_stages: the way to the scheduler's queue, the wait to be scheduled,
the step, the way back). Every timed prompt has documents no other timed prompt of its phase
uses, so a disk-phase prompt loads all its documents from the store (an earlier version reused
one pool, and after the first prompt the disk-warm phase measured GPU hits). The gpu-hit phase
prefills and keeps sum(--docs) x --repeats documents, plus twice max(--docs) (warm-up and
profiled), and is refused when its GPU KV cache cannot hold them all.
After each disk phase the store's load counters (files -> CPU tier per request, see
`minipic store stats`) are added to its result. All phases run in one invocation. `--cpu-gb`
sizes the connector's CPU tier (8 GiB on the 8B model by default): a prompt's loads pass through
it, so 40 documents of 1000 tokens (5 GiB) want more.
The measurement itself is minipic.devtools.ttft_phases (tools/bench_rag.py runs it for Figure 2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from minipic.client.prompts.recipes import RECIPES_BY_NAME  # noqa: E402
from minipic.devtools.bench_setup import (  # noqa: E402
    DEFAULT_DISK_PHASES, add_minipic_option, disk_phase_list, gib, int_list,
    minipic_option_pairs)
from minipic.devtools import gc_pauses, step_phases  # noqa: E402
from minipic.devtools.request_stages import STAGES  # noqa: E402
from minipic.devtools.stack_sampler import ENV_FOLDER  # noqa: E402
from minipic.devtools.ttft_phases import SERIES, measure  # noqa: E402


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
                             "largest count) under vLLM's torch profiler (stock: its rerun, a full "
                             "prefix hit); traces go here")
    parser.add_argument("--profile-stack", action="store_true",
                        help="with --profile-dir: record Python stacks too (where host time goes; "
                             "tools/trace_summary.py lists them)")
    parser.add_argument("--host-profile", type=Path,
                        help="instead of --profile-dir: that prompt under cProfile, the engine "
                             "core in-process (its timings not the benchmark's), one pstats "
                             "text per phase into this folder")
    parser.add_argument("--cpu-gb", type=float, help="the connector's CPU tier (default 8 on 8B)")
    parser.add_argument("--disk-phases", type=disk_phase_list, default=DEFAULT_DISK_PHASES,
                        help="disk phases, e.g. warm:4,warm:16,cold:16 (module docstring)")
    parser.add_argument("--recipe", choices=sorted(RECIPES_BY_NAME), default="block_attention",
                        help="span prompt layout (epic recomputes one link block per document, "
                             "epic2 two, epic64 64 tokens' worth)")
    parser.add_argument("--paired", action="store_true",
                        help="stock and minipic's GPU hit in one process, their timed prompts "
                             "taking turns (minipic.devtools.ttft_paired): the host's drift "
                             "weighs on both alike. Rows tagged paired")
    parser.add_argument("--stack-samples", type=Path,
                        help="sample every thread of every process during each timed prompt "
                             "(minipic.devtools.stack_sampler) into this folder; "
                             "tools/stack_summary.py reads it. Rows tagged stack_sampled")
    parser.add_argument("--gc-pauses", type=Path,
                        help="record Python's garbage collections in every process "
                             "(minipic.devtools.gc_pauses) into this folder; each timed "
                             "request's collection seconds go to its point (gc_pause_s)")
    parser.add_argument("--step-phases", type=Path,
                        help="time vLLM's and minipic's main host functions in every process "
                             "(minipic.devtools.step_phases, unsampled) into this folder; "
                             "each timed request's seconds by function go to its point "
                             "(phases_s) and a table of medians is printed")
    add_minipic_option(parser)
    args = parser.parse_args()
    if args.profile_dir and args.host_profile:
        parser.error("--profile-dir or --host-profile, not both")
    if args.paired and (args.profile_dir or args.host_profile):
        parser.error("--paired times prompts only: no --profile-dir or --host-profile")
    if args.paired and not torch.cuda.is_available():
        # found here, not as an NVML traceback after stock's engine has started
        parser.error("--paired needs a CUDA GPU: its two engines share one card's memory "
                     "(on a CPU, run without --paired: each phase in its own process)")
    if args.stack_samples:  # the phases' processes inherit it, and start their samplers
        os.environ[ENV_FOLDER] = str(args.stack_samples.resolve())
    if args.gc_pauses:
        os.environ[gc_pauses.ENV_FOLDER] = str(args.gc_pauses.resolve())
    if args.step_phases:
        os.environ[step_phases.ENV_FOLDER] = str(args.step_phases.resolve())
    results = measure(args.arch, args.docs, args.doc_tokens, args.repeats, args.eager,
                      save=lambda results: save(results, args), profile_dir=args.profile_dir,
                      disk_phases=args.disk_phases, cpu_bytes=gib(args.cpu_gb),
                      recipe=args.recipe,
                      minipic_options=minipic_option_pairs(args.minipic_option),
                      profile_stack=args.profile_stack, host_profile_dir=args.host_profile,
                      paired=args.paired)
    report(results, args)


def save(results: list[dict], args) -> None:
    if args.out:
        options = {k: v for k, v in vars(args).items() if k != "out"}
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
        print("| phase | median TTFT (ms) | cached tokens / prompt tokens | speed-up vs stock | "
              + " | ".join(STAGES) + " (medians, ms) |")
        print("| --- | --- | --- | --- |" + " --- |" * len(STAGES))
        stock_point = point["stock"]
        # (name, median TTFT, cached tokens of each prompt or None, prompt tokens, stages)
        rows = [(phase, p["median_ttft_s"], p["cached_tokens"], p["prompt_tokens"],
                 p.get("median_stages_s")) for phase, p in point.items()]
        rows.insert(1, ("stock rerun (full prefix hit)", stock_point["median_rerun_ttft_s"],
                        None, None, stock_point.get("median_rerun_stages_s")))
        if "median_newq_ttft_s" in stock_point:
            rows.insert(2, ("stock, new question (prefix hit)", stock_point["median_newq_ttft_s"],
                            stock_point["newq_cached_tokens"], stock_point["prompt_tokens"],
                            stock_point.get("median_newq_stages_s")))
        for name, ttft, cached_tokens, prompt_tokens, stages in rows:
            cached = "-" if cached_tokens is None else \
                f"{min(cached_tokens)}-{max(cached_tokens)} / {prompt_tokens}"
            split = " | ".join(f"{stages[s] * 1e3:.1f}" if stages else "-" for s in STAGES)
            print(f"| {name} | {ttft * 1e3:.1f} | {cached} | {stock / ttft:.1f}x | {split} |")
        for name, p in point.items():
            for series, called in SERIES.items():
                label = f"{name} {called}".strip()
                if f"{series}gc_pause_s" in p:
                    print(f"{label}: garbage collections inside each timed request (ms): "
                          + ", ".join(f"{s * 1e3:.1f}" for s in p[f"{series}gc_pause_s"]))
        print_phases(point)
        hit = point["gpu-hit"]["median_ttft_s"]
        floors = [("stock's full prefix hit", stock_point["median_rerun_ttft_s"]),
                  ("stock's hit with a new question", stock_point.get("median_newq_ttft_s"))]
        print("gpu-hit / " + "; / ".join(f"{label} = {hit / floor:.3f}"
                                          for label, floor in floors if floor))
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


def print_phases(point: dict) -> None:
    """--step-phases: each timed function's median seconds a request, stock's full hit
    beside minipic's GPU hit."""
    columns = [("stock rerun (full prefix hit)", point["stock"].get("rerun_phases_s")),
               ("stock, new question", point["stock"].get("newq_phases_s")),
               ("gpu-hit", point.get("gpu-hit", {}).get("phases_s"))]
    columns = [(label, per_request) for label, per_request in columns if per_request]
    if not columns:
        return
    names = {n for _, per_request in columns for calls in per_request for n in calls}
    median = lambda per_request, n: statistics.median(c.get(n, 0.0) for c in per_request)
    print("| function (inclusive; median ms a request) | "
          + " | ".join(label for label, _ in columns) + " |")
    print("| --- |" + " --- |" * len(columns))
    for n in sorted(names, key=lambda n: -median(columns[-1][1], n)):
        print(f"| {n} | " + " | ".join(f"{median(c, n) * 1e3:.2f}" for _, c in columns) + " |")


if __name__ == "__main__":
    main()
