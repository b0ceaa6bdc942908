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
     the system prompt in a new order, so the prefix cache only reuses the system prompt);
  2. gpu-hit: minipic with MiniPICConnector on a fresh store; spans prefilled once, then the
     final prompts hit them in GPU memory;
  3. disk-warm: a new process on the same store; the spans come from the disk tier.
TTFT = wall time of one request with max_tokens=1, requests one at a time, median of --repeats
prompts. Every timed prompt has documents no other timed prompt of its phase uses, so a
disk-warm prompt loads all its documents from the store (an earlier version reused one pool,
and after the first prompt the disk-warm phase measured GPU hits). The gpu-hit phase prefills
and keeps sum(--docs) x --repeats documents, plus twice max(--docs) (warm-up and profiled).
All phases run in one invocation.
`measure()` is the same run as a function (tools/bench_rag.py uses it for Figure 2).
"""

from __future__ import annotations

import argparse
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

TINY_MARKERS = {"ssep_token_id": 3, "pdep_token_id": 4, "pad_token_id": 5}
PHASES = ("stock", "gpu-hit", "disk-warm")


def make_model(arch: str, root: Path) -> tuple[str, dict, dict]:
    """Model dir, engine kwargs and marker ids for the chosen architecture."""
    if arch == "tiny":
        from minipic.devtools.tiny_llama import build_tiny_llama

        path = build_tiny_llama(root / "tiny")
        return str(path), dict(dtype="float32", block_size=32, enforce_eager=True,
                               gpu_memory_utilization=0.1, max_model_len=4096), TINY_MARKERS
    from minipic.devtools import llama3_8b

    path = llama3_8b.write_config(root / "llama3-8b")
    return str(path), dict(dtype="bfloat16", block_size=16, load_format="dummy",
                           skip_tokenizer_init=True, gpu_memory_utilization=0.85,
                           max_model_len=32768), llama3_8b.MARKERS


def connector_extra(arch: str, store: str, markers: dict) -> dict:
    """MiniPICConnector options. The 8B model gets an 8 GiB CPU tier: 4 steps of 16384
    tokens, so that span bursts reach the store whole (minipic's cpu_tier_sizing warns
    below 2 steps; the 2 GiB default drops stores at this size)."""
    extra = {"store_dir": store, **markers}
    if arch == "llama3-8b":
        extra["cpu_bytes"] = 8 << 30
    return extra


def random_words(rng: random.Random, arch: str):
    """n random ordinary token ids (above every special and marker id of either model)."""
    vocab = 400 if arch == "tiny" else 120000
    return lambda n: [rng.randrange(10, vocab) for _ in range(n)]


def workload(arch: str, doc_counts: list[int], doc_tokens: int, repeats: int, block_size: int,
             markers: dict) -> dict:
    """Token-id prompts: span prefills and final prompts (Block-Attention layout).

    Every timed prompt (each document count, each repeat) has documents of its own, used by no
    other timed prompt of the phase: in the disk-warm phase each prompt then really loads its
    documents from the store, instead of hitting copies an earlier prompt already loaded into
    GPU memory. The phases share the document sets (the spans come from the gpu-hit phase) and
    differ in the question and the document order.
    """
    from minipic.client import block_attention
    from minipic.protocol import SpanProtocol

    rng = random.Random(0)
    words = random_words(rng, arch)
    protocol = SpanProtocol.from_dict(markers)
    system = words(64)
    doc_sets = [(k, [words(doc_tokens) for _ in range(k)]) for k in doc_counts
                for _ in range(repeats)]
    warm_docs = [words(doc_tokens) for _ in range(max(doc_counts))]
    make = lambda docs: block_attention(rng.sample(docs, len(docs)), words(32), system=system,
                                        protocol=protocol, block_size=block_size)
    finals = {phase: [[k, make(docs).final] for k, docs in doc_sets] for phase in PHASES}
    # Warm-up: the same kinds of steps on other documents (their spans are stored too, so the
    # disk-warm phase also warms its load path), so first-launch costs stay out of the timing.
    warmups = {phase: [make(warm_docs[:k]).final for k in doc_counts for _ in range(2)]
               for phase in PHASES}
    # One more prompt per phase, on fresh documents, for --profile-dir (not timed).
    profile_docs = [words(doc_tokens) for _ in range(max(doc_counts))]
    profiled = {phase: make(profile_docs).final for phase in PHASES}
    every_doc = [doc for _, docs in doc_sets for doc in docs] + warm_docs + profile_docs
    return {"prefills": make(every_doc).span_prefills, "finals": finals, "warmups": warmups,
            "profiled": profiled}


def final_prompt_tokens(doc_counts: list[int], doc_tokens: int, block_size: int) -> int:
    """The longest final prompt: system 64 + padded SSep documents + PDep question 32."""
    span = -(-(doc_tokens + 1) // block_size) * block_size
    return 64 + max(doc_counts) * span + 32


def run_phase(phase: str, model: str, engine: dict, connector: dict, load: dict,
              profile_dir: str | None = None) -> dict:
    """In this process: start one engine, time the final prompts."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(engine, model=model, enable_prefix_caching=True, seed=0)
    if profile_dir:
        kwargs["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": profile_dir,
                                     "torch_profiler_with_stack": False}
    if phase != "stock":
        kwargs["kv_transfer_config"] = {
            "kv_connector": "MiniPICConnector", "kv_connector_module_path": "minipic.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": connector}
    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    run = lambda prompts: llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                       params, use_tqdm=False)
    run([[11] * 64])  # kernels compiled/loaded before timing
    if phase == "gpu-hit":
        run(load["prefills"])
    for final in load["warmups"][phase]:
        run([final])
    points: dict[int, dict] = {}
    for docs, final in load["finals"][phase]:
        start = time.perf_counter()
        [out] = run([final])
        point = points.setdefault(docs, {"docs": docs, "ttft_s": [], "cached_tokens": [],
                                         "prompt_tokens": len(final)})
        point["ttft_s"].append(time.perf_counter() - start)
        point["cached_tokens"].append(out.num_cached_tokens)
    if profile_dir:  # one more max-size prompt on fresh documents, under the torch profiler
        llm.start_profile(profile_prefix=phase)
        run([load["profiled"][phase]])
        llm.stop_profile()
    llm.llm_engine.engine_core.shutdown()  # the disk tier finishes its writes
    for point in points.values():
        point["median_ttft_s"] = statistics.median(point["ttft_s"])
    return {"phase": phase, "points": list(points.values())}


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
    parser.add_argument("--phase", help=argparse.SUPPRESS)  # child process entry
    parser.add_argument("--child-args", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        child = json.loads(args.child_args.read_text())
        print("RESULT " + json.dumps(run_phase(args.phase, **child)), flush=True)
        return
    results = measure(args.arch, args.docs, args.doc_tokens, args.repeats, args.eager,
                      save=lambda results: save(results, args), profile_dir=args.profile_dir)
    report(results, args)


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def measure(arch: str, doc_counts: list[int], doc_tokens: int, repeats: int, eager: bool,
            save=lambda results: None, profile_dir: Path | None = None) -> list[dict]:
    """All phases, each in its own process; `save(results)` after each (a late failure keeps
    the earlier phases). Returns one dict per phase, {"phase", "points"} or {"phase", "error"}."""
    with tempfile.TemporaryDirectory() as tmp:
        model, engine, markers = make_model(arch, Path(tmp))
        needed = final_prompt_tokens(doc_counts, doc_tokens, engine["block_size"]) + 64
        engine["max_model_len"] = max(engine["max_model_len"], needed)
        engine["enforce_eager"] = engine.get("enforce_eager", False) or eager
        load = workload(arch, doc_counts, doc_tokens, repeats, engine["block_size"], markers)
        child = Path(tmp) / "child.json"  # token lists: too long for a command line
        connector = connector_extra(arch, f"{tmp}/store", markers)
        child.write_text(json.dumps(dict(model=model, engine=engine, connector=connector,
                                         load=load, profile_dir=profile_dir and str(profile_dir))))
        results = []
        for phase in PHASES:
            results.append(run_child(phase, child))
            save(results)
    return results


def run_child(phase: str, child: Path) -> dict:
    cmd = [sys.executable, __file__, "--phase", phase, "--child-args", str(child)]
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        print(f"phase {phase} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
        return {"phase": phase, "error": proc.stderr[-3000:]}
    return json.loads(lines[-1][len("RESULT "):])


def save(results: list[dict], args) -> None:
    if args.out:
        options = {k: v for k, v in vars(args).items() if k not in ("out", "phase", "child_args")}
        args.out.write_text(json.dumps({"args": options, "results": results}, indent=1))


def report(results: list[dict], args) -> None:
    by_phase = {r["phase"]: r for r in results if "error" not in r}
    if len(by_phase) < len(PHASES):
        sys.exit(f"phases that failed: {sorted(set(PHASES) - set(by_phase))}")
    for i, docs in enumerate(args.docs):
        point = {phase: r["points"][i] for phase, r in by_phase.items()}
        stock = point["stock"]["median_ttft_s"]
        print(f"{docs} documents x {args.doc_tokens} tokens, {args.arch}, "
              f"median of {args.repeats} final prompts")
        print("| phase | median TTFT (ms) | cached tokens / prompt tokens | speed-up vs stock |")
        print("| --- | --- | --- | --- |")
        for phase, p in point.items():
            print(f"| {phase} | {p['median_ttft_s'] * 1e3:.1f} | "
                  f"{min(p['cached_tokens'])}-{max(p['cached_tokens'])} / {p['prompt_tokens']} | "
                  f"{stock / p['median_ttft_s']:.1f}x |")
        disk, hit = point["disk-warm"]["median_ttft_s"], point["gpu-hit"]["median_ttft_s"]
        print(f"disk-warm / gpu-hit = {disk / hit:.2f} (goal <= 3); stock / disk-warm = "
              f"{stock / disk:.1f} (goal >= 10)\n")


if __name__ == "__main__":
    main()
