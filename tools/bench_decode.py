"""Decode step time at a large batch: stock vLLM (FA3) on plain prompts vs minipic on span prompts.

    tools/gpu_run.sh python3 tools/bench_decode.py --modes eager,compiled --out $OUT/decode

Every request reads the same context (a 64-token system prompt and 10 documents of 400
tokens: 4064 tokens as plain text) followed by a question of its own (90 tokens), then
decodes; with --doc-sets N, request i reads the i % N-th of N such contexts. Stock vLLM
gets the plain tokens (no markers); minipic the recipe's span prompt of the same words
(default epic64: each document's first 64 tokens recomputed in context as link blocks),
after the spans were prefilled once. Both serve the shared context from their prefix
cache, so each engine holds it once, and the batch (--batch requests) decodes over it.
Stock FA3 reads the shared context once per request; minipic reads each shared document
once per step for all requests that hold it (segment_plan._shared, as vLLM's cascade
attention reads a shared prefix), so --doc-sets also shows the step with less sharing.

Per engine (one process each, Llama-3-8B shape, dummy weights, bf16, block 16): one warm-up
round, then --rounds rounds of --batch requests with fresh questions, each decoding
--steps tokens; a step counts when every request of the batch decoded in it (no prefill
mixed in). Reported: the median step time over all counted steps, per engine and mode
(eager, or compiled with CUDA graphs), and minipic / stock side by side. --profile-dir
traces a few decode steps of one more round per engine, after its prefills
(tools/trace_summary.py summarises it); --host-profile DIR profiles the host side of such
steps with cProfile instead (engine core in this process: its step times are not the
benchmark's), one pstats text per engine and mode.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from minipic.client.prompts.recipes import RECIPES_BY_NAME  # noqa: E402
from minipic.config import DEFAULT_SERVER_RECIPE  # noqa: E402
from minipic.devtools.bench_setup import make_model, random_words  # noqa: E402
from minipic.devtools.timing import cpu_seconds, cpu_shares  # noqa: E402

# minipic_plain: minipic on, stock's plain prompts (what minipic costs a user without markers)
ENGINES = ("stock", "minipic", "minipic_plain")
PROFILED_STEPS = 6
HOST_PROFILED_STEPS = 32


def prompts(args, markers: dict, block_size: int) -> dict:
    """Token ids for every round (warm-up first): plain and span prompts of the same words.
    Request i of a round reads document set i % --doc-sets."""
    from minipic.protocol import SpanProtocol

    rng = random.Random(0)
    words = random_words(rng, args.arch)
    system = words(64)
    doc_sets = [[words(args.doc_tokens) for _ in range(args.docs)] for _ in range(args.doc_sets)]
    build = RECIPES_BY_NAME[args.recipe]
    protocol = SpanProtocol.from_dict(markers)
    rounds = [[words(args.task_tokens) for _ in range(args.batch)]
              for _ in range(args.rounds + 1)]

    def span(i, task):
        return build(doc_sets[i % args.doc_sets], task, system=system, protocol=protocol,
                     block_size=block_size)

    def plain(i, task):
        return system + [t for d in doc_sets[i % args.doc_sets] for t in d] + task

    return {"stock": [[plain(i, task) for i, task in enumerate(tasks)] for tasks in rounds],
            "minipic": [[span(i, task).final for i, task in enumerate(tasks)]
                        for tasks in rounds],
            "span_prefills": [p for i in range(args.doc_sets)
                              for p in span(i, rounds[0][0]).span_prefills]}


def engine_child(spec: dict) -> dict:
    """In this process: one engine, its decode steps timed."""
    if spec.get("host_profile"):  # cProfile sees the engine core and worker in-process only
        from minipic.devtools.host_profile import run_engine_core_here

        run_engine_core_here()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(spec["engine"], model=spec["model"], enable_prefix_caching=True, seed=0,
                  max_num_seqs=spec["batch"], enforce_eager=spec["mode"] == "eager",
                  max_model_len=min(8192, spec["engine"]["max_model_len"]))
    if spec["name"] != "stock":
        kwargs["additional_config"] = {"minipic": spec["markers"]}
    if spec.get("profile_dir"):
        kwargs["profiler_config"] = {"profiler": "torch",
                                     "torch_profiler_with_stack": spec["profile_stack"],
                                     "torch_profiler_dir": spec["profile_dir"]}
    llm = LLM(**kwargs)
    load = json.loads(Path(spec["prompts"]).read_text())
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    if spec["name"] == "minipic":
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in load["span_prefills"]], one,
                     use_tqdm=False)
    rounds = load["stock" if spec["name"] == "minipic_plain" else spec["name"]]
    llm.generate([TokensPrompt(prompt_token_ids=rounds[0][0])], one, use_tqdm=False)
    params = SamplingParams(max_tokens=spec["steps"] + 1, temperature=0.0, ignore_eos=True)
    steps, cached, context = [], [], len(rounds[0][0])
    for index, tasks in enumerate(rounds):
        if index == 1:
            began, cpu_began = time.perf_counter(), cpu_seconds()
        times, hits = decode_round(llm, tasks, params, f"r{index}")
        if index:  # round 0 warms up
            steps += times
            cached += hits
    shares = cpu_shares(cpu_began, time.perf_counter() - began)
    if spec.get("profile_dir"):  # the warm-up's questions again (prefix hits)
        profile_decode(llm, rounds[0], f"{spec['name']}-{spec['mode']}")
    if spec.get("host_profile"):
        host_profile_decode(llm, rounds[0], Path(spec["host_profile"])
                            / f"{spec['name']}-{spec['mode']}.txt")
    llm.llm_engine.engine_core.shutdown()
    import torch
    import vllm

    return {"engine": spec["name"], "mode": spec["mode"], "batch": spec["batch"],
            "vllm": vllm.__version__, "in_process": bool(spec.get("host_profile")),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
            "context_tokens": context, "counted_steps": len(steps),
            "median_step_ms": statistics.median(steps) * 1e3,
            "p90_step_ms": sorted(steps)[int(0.9 * len(steps))] * 1e3,
            "cached_fraction": sum(cached) / (len(cached) * context), **shares}


def decode_round(llm, tasks: list[list[int]], params, tag: str) -> tuple[list[float], list[int]]:
    """Seconds of each step in which every request decoded, and each request's cached tokens."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    for i, prompt in enumerate(tasks):
        engine.add_request(f"{tag}-{i}", TokensPrompt(prompt_token_ids=prompt), params)
    tokens = {f"{tag}-{i}": 0 for i in range(len(tasks))}
    times, cached = [], []
    while engine.has_unfinished_requests():
        began = time.perf_counter()
        outputs = engine.step()
        took = time.perf_counter() - began
        decoding = len(outputs) == len(tasks) and all(tokens[o.request_id] for o in outputs)
        for o in outputs:
            tokens[o.request_id] = len(o.outputs[0].token_ids)
            if o.finished:
                cached.append(o.num_cached_tokens)
        if decoding:
            times.append(took)
    return times, cached


def profile_decode(llm, tasks: list[list[int]], prefix: str) -> None:
    """Trace PROFILED_STEPS steps in which every request decodes: the prefills run first,
    untraced, so the trace holds decode steps only."""
    decode_steps(llm, tasks, "prof", torch_profile(llm, prefix), PROFILED_STEPS)


@contextlib.contextmanager
def torch_profile(llm, prefix: str):
    llm.start_profile(profile_prefix=prefix)
    try:
        yield
    finally:
        llm.stop_profile()


def host_profile_decode(llm, tasks: list[list[int]], path: Path) -> None:
    """cProfile of HOST_PROFILED_STEPS decode steps (engine core in-process) to `path`."""
    from minipic.devtools.host_profile import host_profile

    title = f"{HOST_PROFILED_STEPS} decode steps of {len(tasks)} requests"
    decode_steps(llm, tasks, "host", host_profile(path, title), HOST_PROFILED_STEPS)


def decode_steps(llm, tasks: list[list[int]], tag: str, watched, steps: int) -> None:
    """`tasks` run to their end; `steps` steps in which every request decodes (their
    prefills before) run inside the context manager `watched`."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(tasks):
        engine.add_request(f"{tag}-{i}", TokensPrompt(prompt_token_ids=prompt), params)
    decoded: set[str] = set()
    while len(decoded) < len(tasks):  # until every request has its first token
        decoded |= {o.request_id for o in engine.step() if o.outputs[0].token_ids}
    with watched:
        for _ in range(steps):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()


def run_child(spec: dict, work: Path) -> dict:
    path = work / f"{spec['name']}-{spec['mode']}.json"
    path.write_text(json.dumps(spec))
    done = subprocess.run([sys.executable, __file__, "--child", str(path)], capture_output=True,
                          text=True)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise SystemExit(f"{spec['name']} ({spec['mode']}) failed:\n{done.stderr[-4000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--arch", choices=["llama3-8b", "tiny"], default="llama3-8b",
                        help="tiny: a CPU smoke run (its numbers are not the product's)")
    parser.add_argument("--modes", default="eager", help="eager,compiled")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--docs", type=int, default=10)
    parser.add_argument("--doc-tokens", type=int, default=400)
    parser.add_argument("--task-tokens", type=int, default=90)
    parser.add_argument("--doc-sets", type=int, default=1,
                        help="distinct document sets, request i reads set i %% N (1: every "
                             "request the same documents)")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--recipe", choices=sorted(RECIPES_BY_NAME), default=DEFAULT_SERVER_RECIPE)
    parser.add_argument("--profile-dir", type=Path,
                        help="also trace a few decode steps of one more round per engine "
                             "(torch profiler; its prefills untraced)")
    parser.add_argument("--profile-stack", action="store_true",
                        help="the traces record Python stacks (where host time goes; slower)")
    parser.add_argument("--host-profile", type=Path,
                        help="also cProfile the host side of some decode steps of one more "
                             "round per engine (engine core in-process), into this folder")
    parser.add_argument("--engines", default="stock,minipic",
                        help="of stock,minipic,minipic_plain (minipic on, plain prompts); "
                             "ratios to stock for those run with it")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(engine_child(json.loads(args.child.read_text()))), flush=True)
        return
    if args.out is None:
        parser.error("--out is required")
    engines = args.engines.split(",")
    if not set(engines) <= set(ENGINES) or len(set(engines)) != len(engines):
        parser.error(f"--engines: some of {', '.join(ENGINES)}")
    if args.doc_sets < 1:
        parser.error("--doc-sets: at least 1")
    if args.rounds < 1:
        parser.error("--rounds: at least 1 (round 0 only warms up)")
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-decode-"))
    model, engine, markers = make_model(args.arch, work)
    (work / "prompts.json").write_text(json.dumps(prompts(args, markers, engine["block_size"])))
    rows = []
    for mode in args.modes.split(","):
        for name in engines:
            spec = dict(name=name, mode=mode, model=model, engine=engine, markers=markers,
                        prompts=str(work / "prompts.json"), batch=args.batch, steps=args.steps,
                        profile_dir=args.profile_dir and str(args.profile_dir),
                        profile_stack=args.profile_stack,
                        host_profile=args.host_profile and str(args.host_profile))
            rows.append(run_child(spec, work))
            print(json.dumps(rows[-1]), flush=True)
            save(args, rows)  # a run cut at its time limit keeps what finished


def save(args, rows: list[dict]) -> None:
    ratios: dict[str, dict] = {"minipic": {}, "minipic_plain": {}}
    for mode in {r["mode"] for r in rows}:
        # A --host-profile run's rows (engine core in-process) time another layout: no ratios.
        by = {r["engine"]: r for r in rows if r["mode"] == mode and not r.get("in_process")}
        for name in ratios:
            if name in by and "stock" in by:
                ratios[name][mode] = round(by[name]["median_step_ms"]
                                           / by["stock"]["median_step_ms"], 3)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
              "minipic_vs_stock": ratios["minipic"],
              "minipic_plain_vs_stock": ratios["minipic_plain"]}
    (args.out / "results.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
