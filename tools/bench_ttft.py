"""TTFT of a RAG final prompt: stock vLLM vs minipic GPU hit vs minipic disk-warm after a restart.

    # H200, vLLM 0.25.1 bundle, Llama-3-8B shape with dummy weights:
    .bundle/run_with_bundle.sh .bundle/vllm-0.25.1-sm90.tar.xz \\
        python3 tools/bench_ttft.py --arch llama3-8b --docs 10 --doc-tokens 1000 --out $OUT/ttft.json
    # CPU smoke run on the tiny random model (numbers are not the product's):
    python tools/bench_ttft.py --arch tiny --docs 4 --doc-tokens 200

Each phase runs in its own process, as a restart would:
  1. stock: vLLM without minipic; every final prompt is prefilled in full (its documents follow
     the system prompt in a new order, so the prefix cache only reuses the system prompt);
  2. gpu-hit: minipic with MiniPICConnector on a fresh store; spans prefilled once, then the
     final prompts hit them in GPU memory;
  3. disk-warm: a new process on the same store; the spans come from the disk tier.
TTFT = wall time of one request with max_tokens=1, requests one at a time, median of --repeats
prompts (each a different document order and question). All phases run in one invocation.
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


def workload(args, markers: dict) -> dict:
    """Token-id prompts: span prefills and final prompts (Block-Attention layout)."""
    from minipic.client import block_attention
    from minipic.protocol import SpanProtocol

    rng = random.Random(0)
    vocab = 400 if args.arch == "tiny" else 120000
    words = lambda n: [rng.randrange(10, vocab) for _ in range(n)]
    protocol = SpanProtocol.from_dict(markers)
    docs, system = [words(args.doc_tokens) for _ in range(args.docs)], words(64)
    make = lambda: block_attention(rng.sample(docs, len(docs)), words(32), system=system,
                                   protocol=protocol, block_size=args.block_size)
    # Every phase asks its own questions: only the spans can come from an earlier phase.
    finals = {phase: [make().final for _ in range(args.repeats)] for phase in PHASES}
    return {"prefills": make().span_prefills, "finals": finals}


def run_phase(phase: str, model: str, engine: dict, markers: dict, store: str, load: dict) -> dict:
    """In this process: start one engine, time the final prompts."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(engine, model=model, enable_prefix_caching=True, seed=0)
    if phase != "stock":
        kwargs["kv_transfer_config"] = {
            "kv_connector": "MiniPICConnector", "kv_connector_module_path": "minipic.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"store_dir": store, **markers}}
    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    run = lambda prompts: llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                       params, use_tqdm=False)
    run([[11] * 64])  # warm-up: kernels compiled/loaded before timing
    if phase == "gpu-hit":
        run(load["prefills"])
    ttfts, cached = [], []
    for final in load["finals"][phase]:
        start = time.perf_counter()
        [out] = run([final])
        ttfts.append(time.perf_counter() - start)
        cached.append(out.num_cached_tokens)
    llm.llm_engine.engine_core.shutdown()  # the disk tier finishes its writes
    return {"phase": phase, "ttft_s": ttfts, "median_ttft_s": statistics.median(ttfts),
            "cached_tokens": cached, "prompt_tokens": [len(f) for f in load["finals"][phase]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", choices=["llama3-8b", "tiny"], default="llama3-8b")
    parser.add_argument("--docs", type=int, default=10)
    parser.add_argument("--doc-tokens", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--eager", action="store_true",
                        help="enforce_eager (faster start; TTFT of long prefills barely changes)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--phase", help=argparse.SUPPRESS)  # child process entry
    parser.add_argument("--child-args", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        child = json.loads(args.child_args.read_text())
        print("RESULT " + json.dumps(run_phase(args.phase, **child)), flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model, engine, markers = make_model(args.arch, Path(tmp))
        engine["enforce_eager"] = engine.get("enforce_eager", False) or args.eager
        args.block_size = engine["block_size"]
        load = workload(args, markers)
        child = Path(tmp) / "child.json"  # token lists: too long for a command line
        child.write_text(json.dumps(dict(model=model, engine=engine, markers=markers,
                                         store=f"{tmp}/store", load=load)))
        results = []
        for phase in PHASES:
            results.append(run_child(phase, child))
            save(results, args)  # keep what finished if a later phase fails
    report(results, args)


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
    stock = by_phase["stock"]["median_ttft_s"]
    print(f"{args.docs} documents x {args.doc_tokens} tokens, {args.arch}, "
          f"median of {args.repeats} final prompts")
    print("| phase | median TTFT (ms) | cached tokens / prompt tokens | speed-up vs stock |")
    print("| --- | --- | --- | --- |")
    for r in by_phase.values():
        print(f"| {r['phase']} | {r['median_ttft_s'] * 1e3:.1f} | "
              f"{min(r['cached_tokens'])}-{max(r['cached_tokens'])} / {r['prompt_tokens'][0]} | "
              f"{stock / r['median_ttft_s']:.1f}x |")
    disk, hit = by_phase["disk-warm"]["median_ttft_s"], by_phase["gpu-hit"]["median_ttft_s"]
    print(f"disk-warm / gpu-hit = {disk / hit:.2f} (goal <= 3); stock / disk-warm = "
          f"{stock / disk:.1f} (goal >= 10)")


if __name__ == "__main__":
    main()
