"""RAG prefill benchmarks after the paper: Table 1 (samples/s), Figure 2 (TTFT, preload), KV sharing.

    # H200, vLLM 0.25.1 bundle (device tool, carry [".bundle"]); a subset of configurations per
    # call, since one device call may take at most 10 minutes:
    tools/gpu_run.sh python3 tools/bench_rag.py table1 --configs 1,2,3 --repeat-rate 0.3 \\
        --samples 4000 --out $OUT/t1-a
    tools/gpu_run.sh python3 tools/bench_rag.py figure2 --out $OUT/fig2
    tools/gpu_run.sh python3 tools/bench_rag.py kv-share --out $OUT/kv
    python3 tools/bench_rag.py report results/t1-a results/t1-b --out results/table1  # merge
    # CPU smoke run on the tiny random model (checks the tool; the numbers mean nothing):
    python tools/bench_rag.py table1 --arch tiny --quick --out /tmp/bench

Every engine runs in its own child process (a fresh engine, as a restart would give), and
results are saved after each child, so a late failure or a device time-out keeps what finished.
docs/benchmarks.md describes the configurations and the commands.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from minipic.client.prompts.recipes import RECIPES_BY_NAME  # noqa: E402
from minipic.devtools import step_phases  # noqa: E402
from minipic.devtools.bench_setup import (  # noqa: E402
    DEFAULT_DISK_PHASES, add_minipic_option, connector_extra, disk_phase_list, gib, int_list,
    kv_bytes_per_token, make_model, minipic_option_pairs, random_words)
from minipic.devtools.rag_workload import TASK_TOKENS, RagWorkload, rag_workload  # noqa: E402
from minipic.devtools.stack_sampler import ENV_FOLDER, sample_window  # noqa: E402
from minipic.devtools.store_totals import store_totals  # noqa: E402
from minipic.devtools.timing import cpu_seconds, cpu_shares, timed  # noqa: E402
# Figure 2's TTFT is tools/bench_ttft.py's run: its phases are engine processes of their own.
from minipic.devtools.ttft_phases import measure as measure_ttft  # noqa: E402

TABLE1_MAX_MODEL_LEN = 2048


# ---------------------------------------------------------------------------- configurations

@dataclasses.dataclass(frozen=True)
class Config:
    key: str
    label: str
    strategy: str  # full-batch | batched | isps
    minipic: bool
    attention: str | None = None  # vLLM attention backend to force (CUDA only)
    disk_warm: bool = False


CONFIGS = {c.key: c for c in [
    Config("1", "stock vLLM, Triton attention", "full-batch", False, attention="TRITON_ATTN"),
    Config("2", "stock vLLM, default attention (FA3 on H200)", "full-batch", False),
    Config("3", "minipic on, no markers", "full-batch", True),
    Config("4", "minipic batched (span prefills, barrier, finals)", "batched", True),
    Config("5", "minipic ISPS", "isps", True),
    Config("6", "minipic ISPS, disk tier warm from a previous run", "isps", True, disk_warm=True),
]}


@dataclasses.dataclass(frozen=True)
class Run:
    """One measured engine: a configuration at one max_num_seqs and one repeat rate."""

    config: str
    max_num_seqs: int
    repeat_rate: float

    @property
    def name(self) -> str:
        return f"{self.config}@{self.max_num_seqs}/r{self.repeat_rate}"


def plan_runs(args) -> list[Run]:
    """--configs 1,5,5:64 -> runs; a bare 5 means every --isps-seqs value."""
    runs = []
    for rate in args.repeat_rate:
        for item in args.configs.split(","):
            key, _, seqs = item.partition(":")
            if key not in CONFIGS:
                sys.exit(f"unknown configuration {key!r}; choose from {', '.join(CONFIGS)}")
            if seqs:
                all_seqs = [int(seqs)]
            elif key == "5":
                all_seqs = args.isps_seqs
            else:
                all_seqs = [args.max_num_seqs]
            runs += [Run(key, s, rate) for s in all_seqs]
    return runs


# ---------------------------------------------------------------------------- workload

def workload_of(spec: dict, repeat_rate: float, samples: int, seed: int) -> RagWorkload:
    """The run's workload from a child spec (or the parent's base dict)."""
    return rag_workload(spec["arch"], samples, repeat_rate, seed, spec["engine"]["block_size"],
                        spec["markers"], spec.get("repeat_window"),
                        spec.get("recipe") or "block_attention")


# ---------------------------------------------------------------------------- strategies
# Each sends one workload through an AsyncLLMBackend (the same front end for every
# configuration, so only the strategy and the engine differ) and returns per-request facts.

async def full_batch(backend, protocol, load: RagWorkload, seqs: int, batch_size: int) -> dict:
    """Every sample is one request, all submitted at once (the engine's max_num_seqs caps)."""
    outcomes = await asyncio.gather(*(backend.complete(p, max_tokens=1)
                                      for p in load.plain_prompts()), return_exceptions=True)
    done = [o for o in outcomes if not isinstance(o, BaseException)]
    prompt, cached = sum(c.prompt_tokens for c in done), sum(c.cached_tokens or 0 for c in done)
    return {"failed": len(outcomes) - len(done), "prompt_tokens": prompt, "cached_tokens": cached,
            "expected_cached_tokens": None, "computed_tokens": prompt - cached}


async def batched(backend, protocol, load: RagWorkload, seqs: int, batch_size: int) -> dict:
    from minipic.client import BatchedScheduler

    scheduler = BatchedScheduler(backend, protocol, batch_size=batch_size, max_in_flight=seqs)
    return summarize(await scheduler.run(rag_requests(load)))


async def isps(backend, protocol, load: RagWorkload, seqs: int, batch_size: int) -> dict:
    from minipic.client import InterleavedScheduler

    scheduler = InterleavedScheduler(backend, protocol, max_in_flight=seqs)
    return summarize(await scheduler.run(rag_requests(load)))


STRATEGIES = {"full-batch": full_batch, "batched": batched, "isps": isps}


def rag_requests(load: RagWorkload) -> list:
    from minipic.client import RagRequest

    return [RagRequest(p, max_tokens=1) for p in load.span_prompts]


def summarize(results: list) -> dict:
    done = [r for r in results if r.ok]
    spans = {s.key: s for r in results for s in r.spans}  # shared spans counted once
    prompt, cached = sum(r.completion.prompt_tokens for r in done), sum(r.cached_tokens or 0
                                                                         for r in done)
    # What the engine computed: final prompts' misses plus each span prefill's misses (a span
    # is sent with one extra token, see minipic/client/span_prefill.py).
    span_work = sum(s.num_tokens + 1 - (s.cached_tokens or 0) for s in spans.values())
    return {"failed": len(results) - len(done),
            "first_error": next((repr(r.error) for r in results if not r.ok), None),
            "prompt_tokens": prompt, "cached_tokens": cached,
            "expected_cached_tokens": sum(r.expected_cached_tokens for r in done),
            "computed_tokens": prompt - cached + span_work,
            "span_prefills": len(spans),
            "spans_already_cached": sum(bool(s.already_stored) for s in spans.values())}


# ---------------------------------------------------------------------------- engines

def is_cuda() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cuda()


def connector_config(arch: str, store: str, markers: dict, disk_max_bytes: int | None,
                     cpu_bytes: int | None = None):
    """A KVTransferConfig object: LLM(...) converts a dict itself, (Async)EngineArgs on
    vLLM 0.25.1 does not."""
    from vllm.config import KVTransferConfig

    from minipic.config import connector_config

    extra = connector_extra(arch, store, markers, cpu_bytes)
    if disk_max_bytes:
        extra["disk_max_bytes"] = disk_max_bytes
    return KVTransferConfig(**connector_config(extra))


def engine_args(spec: dict, config: Config, max_num_seqs: int) -> tuple[dict, str]:
    """AsyncEngineArgs keywords for a configuration, and what attention it asked for."""
    args = dict(spec["engine"], model=spec["model"], enable_prefix_caching=True, seed=0,
                max_num_seqs=max_num_seqs)
    attention = "default"
    if config.attention:
        if is_cuda():
            args["attention_config"] = {"backend": config.attention}
            attention = config.attention
        else:  # vLLM has one attention backend on CPU: configs 1 and 2 are the same engine
            attention = f"CPU backend ({config.attention} exists on CUDA only)"
    options = {**spec["markers"], **(spec.get("minipic_options") or {})}
    if config.disk_warm:
        args["kv_transfer_config"] = connector_config(spec["arch"], spec["store"], options,
                                                      spec.get("disk_max_bytes"),
                                                      spec.get("cpu_bytes"))
    elif config.minipic:
        args["additional_config"] = {"minipic": options}
    return args, attention


# ---------------------------------------------------------------------------- children

async def table1_child(spec: dict) -> dict:
    """One configuration in this process: warm up, then time the whole workload."""
    from minipic.client.backends import AsyncLLMBackend
    from minipic.protocol import SpanProtocol

    run, config = Run(**spec["run"]), CONFIGS[spec["run"]["config"]]
    load = workload_of(spec, run.repeat_rate, spec["samples"], spec["seed"])
    # Other documents for the warm-up, so that it leaves nothing the measured pass could hit.
    warm = workload_of(spec, run.repeat_rate, spec["warmup"], spec["seed"] + 10_000)
    args, attention = engine_args(spec, config, run.max_num_seqs)
    if spec.get("profile_dir"):
        args["profiler_config"] = step_profiler(spec["profile_dir"], run.name,
                                                spec["profile_steps"])
    backend = AsyncLLMBackend.start(**args)
    protocol = SpanProtocol.from_dict(spec["markers"])
    strategy = STRATEGIES[config.strategy]
    try:
        await strategy(backend, protocol, warm, run.max_num_seqs, spec["batch_size"])
        if spec.get("profile_dir"):
            await backend.engine.start_profile()  # records its steps, then stops itself
        # time.monotonic: the clock every process's step phases read
        began, cpu_began = time.monotonic(), cpu_seconds()
        with sample_window(run.name):
            facts = await strategy(backend, protocol, load, run.max_num_seqs, spec["batch_size"])
        ended = time.monotonic()
        seconds = ended - began
        facts["pass_monotonic"] = [began, ended]
        facts.update(cpu_shares(cpu_began, seconds))
    finally:
        await backend.close()
    return {"name": run.name, **dataclasses.asdict(run), "label": config.label,
            "strategy": config.strategy, "attention": attention, "samples": spec["samples"],
            "measured_repeat_rate": load.repeat_rate, "unique_docs": load.unique_docs,
            "repeat_window": spec.get("repeat_window"), "seconds": seconds,
            "samples_per_s": spec["samples"] / seconds,
            "profiled": bool(spec.get("profile_dir")),
            "profile_steps": spec["profile_steps"] if spec.get("profile_dir") else None,
            "stack_sampled": bool(os.environ.get(ENV_FOLDER)),
            "step_phases": bool(os.environ.get(step_phases.ENV_FOLDER)), **facts}


# Steps of the measured pass under the torch profiler with --profile-dir: a few steady-state
# steps, after the first ones (which still fill the batch), so traces stay small. A short
# pass (ISPS at a high repeat rate: some 30 engine steps, empty ones counted) needs fewer
# skipped: --profile-steps.
PROFILE_STEPS = (20, 5)  # skipped, traced


def step_profiler(profile_dir: str, run_name: str, steps: tuple[int, int]):
    from vllm.config import ProfilerConfig

    skipped, traced = steps
    return ProfilerConfig(profiler="torch",
                          torch_profiler_dir=str(Path(profile_dir) / slug(run_name)),
                          torch_profiler_with_stack=False, ignore_frontend=True,
                          delay_iterations=skipped, max_iterations=traced)


def parse_profile_steps(text: str) -> tuple[int, int]:
    """'20:5' -> (20, 5): engine steps skipped, then traced."""
    try:
        skipped, traced = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"want SKIPPED:TRACED steps, e.g. 8:10, got {text!r}") from None
    if skipped < 0 or traced < 1:
        raise argparse.ArgumentTypeError(f"want SKIPPED >= 0 and TRACED >= 1, got {text!r}")
    return skipped, traced


async def populate_child(spec: dict) -> dict:
    """Config 6, first pass: prefill every span of the workload into the store, then stop."""
    from minipic.client.backends import AsyncLLMBackend
    from minipic.client.rag.barrier import gather_bounded
    from minipic.client.span_prefill import prefill_span
    from minipic.protocol import SpanProtocol

    run = Run(**spec["run"])
    load = workload_of(spec, run.repeat_rate, spec["samples"], spec["seed"])
    args, _ = engine_args(spec, CONFIGS["6"], run.max_num_seqs)
    backend = AsyncLLMBackend.start(**args)
    protocol = SpanProtocol.from_dict(spec["markers"])
    start = time.perf_counter()
    try:
        spans = load.unique_spans()
        outcomes = await gather_bounded((prefill_span(backend, s, protocol) for s in spans),
                                        run.max_num_seqs)
    finally:
        await backend.close()  # stops the engine core: the disk tier finishes its writes
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    return {"name": f"populate {run.name}", "spans": len(spans), "failed": len(failed),
            "seconds": time.perf_counter() - start}


def kv_share_child(spec: dict) -> dict:
    """Peak KV blocks in use while N requests share one document at different offsets.

    Request i is [SSep filler_i][SSep document][PDep task_i], filler_i being 1-16 blocks: the
    document sits at a different offset in most requests. Every span (the document and each
    filler) is prefilled alone first, as the client tools do; then all requests are submitted
    at once and the engine is stepped by hand, reading the block pool after every step
    (in-process engine core: VLLM_ENABLE_V1_MULTIPROCESSING=0). Stock vLLM gets the same token
    ids: its prefix cache cannot reuse the document after a different filler, so it holds one
    copy per request, which is also what a copy-based PIC scheme holds.
    """
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from minipic.client import block_attention
    from minipic.client.span_prefill import probe_prompt
    from minipic.protocol import SpanProtocol

    block = spec["engine"]["block_size"]
    protocol = SpanProtocol.from_dict(spec["markers"])
    words = random_words(random.Random(spec["seed"]), spec["arch"])
    document = words(spec["doc_tokens"])
    prompts = [block_attention([words((1 + i % 16) * block - 1), document], words(TASK_TOKENS),
                               protocol=protocol, block_size=block)
               for i in range(spec["requests"])]
    config = CONFIGS["3"] if spec["minipic"] else CONFIGS["2"]
    args, _ = engine_args(spec, config, max(spec["requests"], 16))
    llm = LLM(**args)
    one_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    spans = {tuple(s): s for p in prompts for s in p.span_prefills}
    llm.generate([TokensPrompt(prompt_token_ids=probe_prompt(s, protocol))
                  for s in spans.values()], one_token, use_tqdm=False)
    decode = SamplingParams(max_tokens=spec["decode_tokens"], temperature=0.0, ignore_eos=True)
    peak = step_until_done(llm, [p.final for p in prompts], decode)
    doc_blocks = len(prompts[0].span_prefills[-1]) // block
    return {"name": "minipic" if spec["minipic"] else "stock", "requests": len(prompts),
            "doc_blocks": doc_blocks, **peak,
            # minipic's requests, each with a private copy of the document (stock: it is one):
            "copy_based_blocks": peak["peak_blocks"] + (peak["running_at_peak"] - 1) * doc_blocks
            if spec["minipic"] else None,
            "expected_cached_tokens": sum(p.expected_cached_tokens for p in prompts)}


def step_until_done(llm, prompts: list[list[int]], params) -> dict:
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    core = engine.engine_core.engine_core  # InprocClient -> EngineCore
    pool = core.scheduler.kv_cache_manager.block_pool
    in_use = lambda: pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()  # 1: the null block
    before = in_use()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"share-{i}", TokensPrompt(prompt_token_ids=prompt), params)
    peak, running_at_peak, cached, steps = 0, 0, 0, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            cached += output.num_cached_tokens if output.finished else 0
        steps += 1
        if in_use() > peak:
            peak, running_at_peak = in_use(), len(core.scheduler.running)
    return {"blocks_in_use_before": before, "peak_blocks": peak - before,
            "running_at_peak": running_at_peak, "steps": steps, "cached_tokens": cached,
            "total_blocks": pool.num_gpu_blocks - 1}


def preload_child(spec: dict) -> dict:
    """Figure 2, left and middle: prefill time of prompts nothing in the cache can serve.

    Left: one plain prompt (no markers) of each length. Middle: k documents of doc_tokens,
    each an SSep span prefilled as its own request, all k in one batch (as minipic-preload
    sends them). Fresh token ids for every measurement; median of `repeats`.
    """
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from minipic.client import make_span
    from minipic.client.span_prefill import probe_prompt
    from minipic.protocol import SpanProtocol

    protocol = SpanProtocol.from_dict(spec["markers"])
    words = random_words(random.Random(spec["seed"]), spec["arch"])
    config = CONFIGS["3"] if spec["minipic"] else CONFIGS["2"]
    args, _ = engine_args(spec, config, 256)
    llm = LLM(**args)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    run = lambda prompts: llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                       params, use_tqdm=False)
    run([words(64)])  # warm-up
    span = lambda: probe_prompt(make_span(words(spec["doc_tokens"]), protocol,
                                          spec["engine"]["block_size"]), protocol)
    median = lambda make: statistics.median(timed(run, make())[0] for _ in range(spec["repeats"]))
    return {"name": "minipic" if spec["minipic"] else "stock",
            "by_length": [{"tokens": n, "seconds": median(lambda: [words(n)])}
                          for n in spec["lengths"]],
            "by_docs": [{"docs": k, "seconds": median(lambda: [span() for _ in range(k)])}
                        for k in spec["doc_counts"]]}


CHILDREN = {"table1": table1_child, "populate": populate_child, "kv-share": kv_share_child,
            "preload": preload_child}


def child_main(spec_path: Path) -> None:
    spec = json.loads(spec_path.read_text())
    result = CHILDREN[spec["kind"]](spec)
    if asyncio.iscoroutine(result):
        result = asyncio.run(result)
    print("RESULT " + json.dumps(result), flush=True)


def slug(name: str) -> str:
    """A run name (e.g. "5@1024/r0.3") as a file or folder name."""
    return "".join(c if c.isalnum() else "_" for c in name)


def run_child(spec: dict, work: Path, logs: Path, env: dict | None = None) -> dict:
    """Run one child process; its log goes to logs/, its result (or error) comes back."""
    name = spec.get("name", spec["kind"])
    stem = slug(name)
    spec_path = work / f"{stem}.json"
    spec_path.write_text(json.dumps(spec))
    logs.mkdir(parents=True, exist_ok=True)
    env = {"VLLM_CPU_KVCACHE_SPACE": "4", **os.environ, **(env or {})}
    print(f"[bench_rag] {name} ...", flush=True)
    start = time.perf_counter()
    # Both streams to the log: vLLM logs to stdout, an engine core's traceback too.
    with open(logs / f"{stem}.log", "w") as log:
        proc = subprocess.run([sys.executable, __file__, "child", str(spec_path)], env=env,
                              stdout=log, stderr=subprocess.STDOUT)
    text = (logs / f"{stem}.log").read_text(errors="replace")
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = text[-3000:]
        print(f"[bench_rag] {name} failed (rc {proc.returncode}):\n{tail}", file=sys.stderr)
        return {"name": name, "error": tail}
    print(f"[bench_rag] {name} done in {time.perf_counter() - start:.0f} s", flush=True)
    return json.loads(lines[-1][len("RESULT "):])


# ---------------------------------------------------------------------------- table 1

def table1(args, base: dict, work: Path) -> None:
    runs = plan_runs(args)
    results: list[dict] = []
    for run in runs:
        spec = dict(base, kind="table1", name=run.name, run=dataclasses.asdict(run))
        if CONFIGS[run.config].disk_warm:
            spec = disk_tier_spec(spec, run, args, base, work)
            if "error" in spec:
                results.append({"name": run.name, "error": spec["error"]})
                continue
            populated = run_child(dict(spec, kind="populate", name=f"populate {run.name}"),
                                  work, args.out / "logs")
            populated["store_after"] = store_totals(spec["store"])
            spec["populate"] = populated
            if "error" in populated:
                results.append({"name": run.name, "error": "populate: " + populated["error"]})
                save_table1(args, results)
                continue
        result = run_child(spec, work, args.out / "logs")
        if "populate" in spec:
            result["populate"] = spec["populate"]
            result["store_after"] = store_totals(spec["store"])
            shutil.rmtree(spec["store"], ignore_errors=True)
        results.append(result)
        save_table1(args, results)
    print((args.out / "table1.md").read_text())


def disk_tier_spec(spec: dict, run: Run, args, base: dict, work: Path) -> dict:
    """A fresh store for this run; refused (an error entry) when the spans cannot fit on disk."""
    store = Path(args.store_dir or work) / f"store-{run.config}-{run.max_num_seqs}-{run.repeat_rate}"
    load = workload_of(base, run.repeat_rate, base["samples"], base["seed"])
    needed = sum(map(len, load.unique_spans())) * kv_bytes_per_token(base["model"],
                                                                     base["engine"]["dtype"])
    store.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(store.parent).free
    limit = int(args.disk_max_gb * 2**30)
    if needed > min(free * 0.9, limit):
        return {"error": f"the spans need ~{needed / 2**30:.1f} GiB of store, more than the "
                         f"limit ({limit / 2**30:.0f} GiB) or 90% of the free disk "
                         f"({free / 2**30:.0f} GiB): use fewer --samples or a higher repeat rate"}
    return dict(spec, store=str(store), disk_max_bytes=limit, store_bytes_estimate=needed,
                cpu_bytes=gib(args.cpu_gb))


def save_table1(args, results: list[dict]) -> None:
    meta = {k: v for k, v in vars(args).items() if k not in ("out", "func", "command")}
    (args.out / "table1.json").write_text(json.dumps(
        {"args": meta, "host": host_facts(), "results": results}, indent=1, default=str))
    (args.out / "table1.md").write_text(table1_markdown(results, meta))


def table1_markdown(results: list[dict], meta: dict) -> str:
    lines = [f"arch {meta.get('arch')}, seed {meta.get('seed')}", ""]
    # Ratios only between rows of one run (report() tags merged rows with their run).
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        if "error" in r:
            lines.append(f"- {r['name']}: **failed**, see logs/ (`{r['error'][-200:].strip()}`)")
        else:
            groups.setdefault((r.get("run", ""), r["repeat_rate"]), []).append(r)
    for (run, rate), rows in sorted(groups.items()):
        base = {r["config"]: r["samples_per_s"] for r in rows if r["config"] in ("1", "2")}
        ratio = lambda r, k: f"{r['samples_per_s'] / base[k]:.2f}x" if k in base else "-"
        stock = next((r for r in rows if r["config"] == "2"), None)
        where = f", run {run}" if run else ""
        window = rows[0].get("repeat_window")
        where += f", repeats from the {window} newest documents" if window else ""
        if any(r.get("profiled") for r in rows):
            skipped, traced = rows[0]["profile_steps"]
            where += f", {traced} steps of each under the torch profiler (after {skipped})"
        if any(r.get("stack_sampled") for r in rows):
            where += ", every thread stack-sampled (slower)"
        if any(r.get("step_phases") for r in rows):
            where += ", host functions timed (step phases)"
        lines += ["", f"### repeat rate {rate} (measured {rows[0]['measured_repeat_rate']:.3f})"
                      f"{where}, {rows[0]['samples']} samples",
                  "", "| # | configuration | strategy | max_num_seqs | attention | samples/s | "
                  "vs (1) | vs (2) | cached / prompt tokens (expected) | spans prefilled "
                  "(already cached) | computed tokens / sample | bound vs (2) | of bound | "
                  "failed |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
                  "| --- |"]
        for r in rows:
            expected = r.get("expected_cached_tokens")
            spans = (f"{r['span_prefills']} ({r['spans_already_cached']})"
                     if "span_prefills" in r else "-")
            lines.append(f"| {r['config']} | {r['label']} | {r['strategy']} | {r['max_num_seqs']} | "
                         f"{r['attention']} | {r['samples_per_s']:.2f} | {ratio(r, '1')} | "
                         f"{ratio(r, '2')} | {r['cached_tokens']} / {r['prompt_tokens']}"
                         f"{'' if expected is None else f' ({expected})'} | {spans} | "
                         f"{r.get('computed_tokens', 0) / r['samples']:.0f} | "
                         f"{bound_columns(r, stock)} | {r['failed']} |")
        lines += [store_line(r) for r in rows if "store_after" in r]
    return "\n".join(lines) + "\n"


def bound_columns(row: dict, stock: dict | None) -> str:
    """`bound | of bound`: the speed-up over stock FA3 (config 2) that computed tokens alone
    allow (its computed tokens per sample / this row's), and how much of it the row reached
    (issue 15's ISPS goal: 0.95 of it)."""
    if stock is None or not row.get("computed_tokens") or not stock.get("computed_tokens"):
        return "- | -"
    bound = (stock["computed_tokens"] / stock["samples"]) / (row["computed_tokens"] / row["samples"])
    reached = row["samples_per_s"] / stock["samples_per_s"]
    return f"{bound:.2f}x | {reached / bound:.2f}"


def store_line(row: dict) -> str:
    """Config 6: did every span reach the disk, and how much did the measured run load?"""
    written, after = row["populate"].get("store_after", {}), row["store_after"]
    loaded = after.get("hit_bytes", 0) - written.get("hit_bytes", 0)
    return (f"\nConfig {row['config']}: the populating run left {written.get('blocks', '?')} "
            f"blocks ({written.get('bytes', 0) / 2**20:.0f} MiB) in the store; the measured run "
            f"loaded {loaded / 2**20:.0f} MiB from it in "
            f"{after.get('load_jobs', 0) - written.get('load_jobs', 0)} load jobs.")


def host_facts() -> dict:
    """What a result needs to say where it is from: GPU, vLLM, and the attention stock vLLM
    picks there (the figure's "stock vLLM (FA3)")."""
    import vllm

    facts = {"python": sys.version.split()[0], "vllm": vllm.__version__,
             "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "stock_attention": stock_attention()}
    try:
        facts["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                      capture_output=True, text=True).stdout.strip() or None
    except OSError:
        facts["gpu"] = None
    return facts


def stock_attention() -> str:
    """vLLM's default attention for an fp16/bf16 model here: FA3 on Hopper, FA2 on Ampere+
    (when the build has them), else Triton; the CPU backend without a GPU."""
    if not is_cuda():
        return "CPU attention"
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

    version = get_flash_attn_version(head_size=128)
    return f"FA{version}" if version else "Triton"


def report(args) -> None:
    """Merge table1.json files of several invocations into one table (configs split by the
    10-minute device limit). Rows keep their own run's facts; ratios need (1)/(2) at the rate."""
    results, meta = [], {}
    for directory in args.dirs:
        data = json.loads((Path(directory) / "table1.json").read_text())
        results += [dict(r, run=Path(directory).name) for r in data["results"]]
        meta = meta or data["args"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table1.json").write_text(json.dumps(
        {"merged_from": [str(d) for d in args.dirs], "args": meta, "results": results}, indent=1))
    (args.out / "table1.md").write_text(table1_markdown(results, meta))
    print((args.out / "table1.md").read_text())


# ---------------------------------------------------------------------------- figure 2, KV share

def figure2(args, base: dict, work: Path) -> None:
    out = {"args": {k: v for k, v in vars(args).items() if k not in ("out", "func", "command")},
           "host": host_facts()}
    save = lambda: (args.out / "figure2.json").write_text(json.dumps(out, indent=1, default=str))
    if "ttft" in args.parts:  # first: the headline numbers, saved after every phase
        out["ttft"] = measure_ttft(args.arch, args.doc_counts, args.doc_tokens, args.repeats,
                                   args.eager,
                                   save=lambda phases: (out.update(ttft=phases), save()),
                                   disk_phases=args.disk_phases, cpu_bytes=gib(args.cpu_gb))
    if "preload" in args.parts:
        engine = dict(base["engine"], max_model_len=max(args.lengths) + 64)
        out["preload"] = [run_child(dict(base, engine=engine, kind="preload", name=f"preload {impl}",
                                         minipic=impl == "minipic", lengths=args.lengths,
                                         doc_counts=args.doc_counts, doc_tokens=args.doc_tokens,
                                         repeats=args.repeats), work, args.out / "logs")
                          for impl in ("stock", "minipic")]
        save()
    plot_figure2(out, args.out / "figure2.png")


def plot_figure2(data: dict, path: Path) -> None:
    """The three panels (minipic.devtools.figure2_plot); skipped, with a note, where
    matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("[bench_rag] matplotlib not importable: no figure2.png (the JSON has the data)")
        return
    from minipic.devtools.figure2_plot import plot, run_facts

    plot(data, path, run_facts(data))
    print(f"[bench_rag] wrote {path}")


def kv_share(args, base: dict, work: Path) -> None:
    engine = base["engine"]  # its max_model_len (4096 or more) fits 16 filler blocks + the document
    results = []
    for impl in ("minipic", "stock"):
        results.append(run_child(dict(base, engine=engine, kind="kv-share", name=f"kv-share {impl}",
                                      minipic=impl == "minipic", requests=args.requests,
                                      doc_tokens=args.doc_tokens, decode_tokens=args.decode_tokens),
                                 work, args.out / "logs", env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}))
        (args.out / "kv_share.json").write_text(json.dumps(
            {"args": vars(args), "host": host_facts(), "results": results}, indent=1, default=str))
    lines = ["| engine | requests | running at peak | document blocks | peak blocks in use | "
             "a copy per request would need | cached tokens (expected with minipic) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r['name']} | {r.get('requests')} | {r.get('running_at_peak')} | "
                     f"{r.get('doc_blocks')} | {r.get('peak_blocks')} | "
                     f"{r.get('copy_based_blocks') or '-'} | {r.get('cached_tokens')} "
                     f"({r.get('expected_cached_tokens')}) |" if "error" not in r else
                     f"| {r['name']} | failed, see logs/ | | | | | |")
    (args.out / "kv_share.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


# ---------------------------------------------------------------------------- command line

def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def parse_args() -> argparse.Namespace:
    summary, _, examples = __doc__.partition("\n")
    parser = argparse.ArgumentParser(description=summary, epilog=examples,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--arch", choices=["llama3-8b", "tiny"], default="llama3-8b")
    common.add_argument("--out", type=Path, default=Path("bench_rag_out"), help="a directory")
    common.add_argument("--seed", type=int, default=0)
    common.add_argument("--eager", action="store_true", help="enforce_eager (faster start)")
    add_minipic_option(common, "; table1 only")
    common.add_argument("--quick", action="store_true", help="tiny sizes, for smoke runs")
    common.add_argument("--cpu-gb", type=float,
                        help="the connector's CPU tier, config 6 and figure2's TTFT (default: "
                             "8 GiB on the 8B model)")

    t1 = commands.add_parser("table1", parents=[common], help="samples/s per configuration")
    t1.add_argument("--configs", default="1,2,3,4,5,6",
                    help="e.g. 1,3,5 or 5:1024 (a bare 5 runs every --isps-seqs)")
    t1.add_argument("--repeat-rate", type=floats, default=[0.3, 0.4, 0.6, 0.9])
    t1.add_argument("--repeat-window", type=int,
                    help="a repeat draws from the N newest documents only (default: from all "
                         "earlier ones); a window whose spans fit the KV cache models a hot set")
    t1.add_argument("--samples", type=int, default=4000)
    t1.add_argument("--recipe", choices=sorted(RECIPES_BY_NAME), default="block_attention",
                    help="span prompts of configs 4-6 (epic adds one recomputed link block per "
                         "document, epic2 two, epic64 64 tokens' worth); configs 1-3 run the "
                         "plain prompt either way")
    t1.add_argument("--warmup", type=int, default=64, help="samples run before timing")
    t1.add_argument("--max-num-seqs", type=int, default=1024, help="configs 1-4 and 6")
    t1.add_argument("--isps-seqs", type=int_list, default=[64, 1024, 2048])
    t1.add_argument("--batch-size", type=int, default=64, help="config 4's barrier batch")
    t1.add_argument("--max-batched-tokens", type=int,
                    help="vLLM's max_num_batched_tokens (default 16384; vLLM's own on tiny)")
    t1.add_argument("--store-dir", help="where config 6's store goes (default: a temp dir)")
    t1.add_argument("--disk-max-gb", type=float, default=40.0, help="config 6's store limit")
    t1.add_argument("--profile-dir", type=Path,
                    help="trace a few steady-state steps of each measured pass with the torch "
                         "profiler (one folder per configuration; tools/trace_summary.py reads "
                         "them); the rows are then marked as profiled")
    t1.add_argument("--profile-steps", default=PROFILE_STEPS, type=parse_profile_steps,
                    help="SKIPPED:TRACED engine steps of the measured pass (default "
                         "%d:%d)" % PROFILE_STEPS)
    t1.add_argument("--stack-samples", type=Path,
                    help="sample every thread of every process during each measured pass "
                         "(minipic.devtools.stack_sampler) into this folder, one window per "
                         "row; tools/stack_summary.py reads it. Rows tagged stack_sampled")
    t1.add_argument("--step-phases", type=Path,
                    help="time vLLM's and minipic's main host functions in every process "
                         "(minipic.devtools.step_phases) into this folder; "
                         "tools/step_phases_summary.py reads it. Rows tagged step_phases")
    t1.set_defaults(func=table1)

    f2 = commands.add_parser("figure2", parents=[common], help="TTFT and preload times")
    f2.add_argument("--parts", default="preload,ttft")
    f2.add_argument("--disk-phases", type=disk_phase_list, default=DEFAULT_DISK_PHASES,
                    help="bench_ttft.py's disk phases for the TTFT panel")
    f2.add_argument("--doc-counts", type=int_list, default=[1, 2, 5, 10, 20, 30, 40])
    f2.add_argument("--doc-tokens", type=int, default=1000)
    f2.add_argument("--lengths", type=int_list,
                    default=[1000, 2000, 4000, 8000, 16000, 32000])
    f2.add_argument("--repeats", type=int, default=3)
    f2.set_defaults(func=figure2)

    kv = commands.add_parser("kv-share", parents=[common], help="peak KV blocks, shared document")
    kv.add_argument("--requests", type=int, default=64)
    kv.add_argument("--doc-tokens", type=int, default=1000)
    kv.add_argument("--decode-tokens", type=int, default=32,
                    help="keeps requests running, so all of them hold their blocks at once")
    kv.set_defaults(func=kv_share)

    rep = commands.add_parser("report", help="merge table1.json of several runs")
    rep.add_argument("dirs", nargs="+", type=Path)
    rep.add_argument("--out", type=Path, required=True)
    rep.set_defaults(func=None)

    ch = commands.add_parser("child", help="internal: one engine, started by the commands above")
    ch.add_argument("spec", type=Path)
    args = parser.parse_args()
    if getattr(args, "quick", False):
        apply_quick(args)
    return args


def apply_quick(args) -> None:
    """Smoke-run sizes: a handful of samples and points, two repeat rates at most."""
    quick = {"table1": dict(samples=12, warmup=2, repeat_rate=args.__dict__.get("repeat_rate",
                                                                               [0.6])[:1],
                            isps_seqs=[4]),
             "figure2": dict(doc_counts=[1, 3], doc_tokens=100, lengths=[128, 512], repeats=1),
             "kv-share": dict(requests=6, doc_tokens=200, decode_tokens=4)}[args.command]
    for key, value in quick.items():
        setattr(args, key, value)


def main() -> None:
    args = parse_args()
    if args.command == "child":
        child_main(args.spec)
        return
    if args.command == "report":
        report(args)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if getattr(args, "stack_samples", None):  # the children inherit it, and start samplers
        os.environ[ENV_FOLDER] = str(args.stack_samples.resolve())
    if getattr(args, "step_phases", None):  # the children's plugin entry point reads it
        os.environ[step_phases.ENV_FOLDER] = str(args.step_phases.resolve())
    if hasattr(args, "parts"):
        args.parts = args.parts.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        # figure2's preload sends prompts of up to max(--lengths) tokens
        longest = max(args.lengths) + 64 if args.command == "figure2" else 0
        model, engine, markers = make_model(args.arch, Path(tmp), max_model_len=longest)
        engine["enforce_eager"] = engine.get("enforce_eager", False) or args.eager
        if args.command == "table1":
            engine["max_model_len"] = TABLE1_MAX_MODEL_LEN
            # AsyncLLM's engine context gets vLLM's small scheduler default; what LLM(...) gets
            # on an H200 (16384) suits a prefill-throughput run, and is the same for every row.
            if args.max_batched_tokens is None and args.arch != "tiny":
                args.max_batched_tokens = 16384
            if args.max_batched_tokens:
                engine["max_num_batched_tokens"] = args.max_batched_tokens
        base = dict(arch=args.arch, model=model, engine=engine, markers=markers, seed=args.seed,
                    samples=getattr(args, "samples", None), warmup=getattr(args, "warmup", None),
                    batch_size=getattr(args, "batch_size", None),
                    repeat_window=getattr(args, "repeat_window", None),
                    recipe=getattr(args, "recipe", None),
                    minipic_options=minipic_option_pairs(args.minipic_option),
                    profile_dir=str(args.profile_dir.resolve())
                    if getattr(args, "profile_dir", None) else None,
                    profile_steps=getattr(args, "profile_steps", PROFILE_STEPS))
        args.func(args, base, Path(tmp))


if __name__ == "__main__":
    main()
