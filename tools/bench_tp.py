"""Tensor parallel 2 vs 1 with minipic (issue 18 item 1), on one x2 H200 host, vLLM 0.25.1.

    # device tool, kind nvidia-h200-x2, carry [".bundle"]:
    tools/gpu_run.sh python3 tools/bench_tp.py --out $OUT/tp
    # one shape, no reload engine (about half the time):
    tools/gpu_run.sh python3 tools/bench_tp.py --shapes llama3-8b --phases tp1,tp2 --out $OUT/tp

Per shape (llama3-8b: Llama-3-8B; llama3-70b-4l: Llama-3-70B's width and heads, hidden 8192,
64 heads, 8 KV heads, with 4 layers), engines run one after another, each in its own child
process, all with MiniPICConnector on one store_dir (a fresh one per shape):
  1. tp1 (CUDA_VISIBLE_DEVICES=0): the span prefills, then the final prompts (Block-Attention
     and EPIC, documents at new offsets): num_cached_tokens against the expected count, and
     the generated tokens' logprobs;
  2. tp2 (CUDA_VISIBLE_DEVICES=0,1, tensor_parallel_size=2): first "probes" (the same
     documents, other questions) before any prefill: anything cached then could only come from
     tp1's files in the shared store (the store namespace names the TP size: expect none);
     then prefills and finals as tp1;
  3. tp2-reload: a new TP=2 engine on the same store sends the final prompts tp2 sent: every
     full block comes from the store's disk tier (per-rank KV written by tp2's two ranks,
     loaded by both), and the logprobs must still match tp1's.
The headline: max |logprob difference| of tp2's generated tokens vs tp1's on the same final
prompts (bf16), over the tokens before the two greedy continuations first differ.
Weights are seeded normal(0, 0.02) per checkpoint tensor name (norms 1), fed through the
model's own `load_weights`, so each TP rank takes its shard of the same full tensors and TP=1
and TP=2 run the same model (vLLM's dummy values are +-1e-3 and flatten the logits).
Engines are eager (no CUDA graphs): they start in well under a minute each.
Writes OUT/bench_tp.json (the key `tp2_max_logprob_diff_vs_tp1` is the scoreboard's) and
OUT/bench_tp.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {
    "llama3-8b": {},  # minipic.devtools.llama3_8b.CONFIG as it is
    "llama3-70b-4l": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 4,
                      "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128},
}
PHASES = ("tp1", "tp2", "tp2-reload")
TP_OF = {"tp1": 1, "tp2": 2, "tp2-reload": 2}
RECIPES = ("block_attention", "epic")
BLOCK_SIZE = 16
# NVLink multicast stays off on the shared GPU host (it can take its GPUs out of service).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1", "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}
MAX_TOKENS = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", type=choices_list(SHAPES), default=list(SHAPES))
    parser.add_argument("--phases", type=choices_list(PHASES), default=list(PHASES))
    parser.add_argument("--docs", type=int, default=4, help="documents per final prompt")
    parser.add_argument("--doc-tokens", type=int, default=200)
    parser.add_argument("--finals", type=int, default=2, help="final prompts per recipe")
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON and .md")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # one engine's spec
    args = parser.parse_args(argv)
    if "tp1" not in args.phases and not args.child:
        parser.error("--phases needs tp1: the other phases are compared with it")
    return args


def choices_list(allowed):
    def parse(text: str) -> list[str]:
        items = text.split(",")
        bad = [i for i in items if i not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {list(allowed)}")
        return items
    return parse


def build_prompts(docs: int, doc_tokens: int, finals: int, seed: int = 0) -> dict:
    """Token-id prompts: every span prefill once; per recipe `finals` final prompts, each with
    the documents in another order (new offsets) and its own question; and as many probes,
    the same documents with other questions (tp2 sends them before any prefill)."""
    from minipic.client import block_attention, epic
    from minipic.devtools.llama3_8b import MARKERS
    from minipic.protocol import SpanProtocol

    rng = random.Random(seed)
    words = lambda n: [rng.randrange(10, 120000) for _ in range(n)]  # noqa: E731 below specials
    protocol = SpanProtocol.from_dict(MARKERS)
    system, documents = words(64), [words(doc_tokens) for _ in range(docs)]
    build = {"block_attention": block_attention, "epic": epic}
    prompts = {"prefills": [], "finals": [], "probes": []}
    for kind in ("finals", "probes"):
        for recipe in RECIPES:
            for i in range(finals):
                # Rotated: each final puts every document at another offset; probes reversed.
                order = documents[i % docs:] + documents[:i % docs]
                p = build[recipe](order[::-1] if kind == "probes" else order, words(32),
                                  system=system, protocol=protocol, block_size=BLOCK_SIZE)
                prompts["prefills"] += [s for s in p.span_prefills if s not in prompts["prefills"]]
                prompts[kind].append({
                    "recipe": recipe, "tokens": p.final,
                    "expected_cached": p.expected_cached_tokens,
                    # Sent again: every full block hits, but vLLM recomputes the last token.
                    "expected_rerun": (len(p.final) - 1) // BLOCK_SIZE * BLOCK_SIZE})
    return prompts


def compare(reference: list[dict], other: list[dict]) -> dict:
    """Greedy outputs of the same prompts: max |logprob difference| over the tokens before the
    two continuations first differ (after that they answer different contexts)."""
    diffs, diverged = [], 0
    for a, b in zip(reference, other, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y),
                    min(len(a["tokens"]), len(b["tokens"])))
        diverged += same < max(len(a["tokens"]), len(b["tokens"]))
        diffs += [abs(x - y) for x, y in zip(a["lp"][:same], b["lp"][:same])]
    return {"max_abs_logprob_diff": max(diffs, default=None), "compared_tokens": len(diffs),
            "diverged_prompts": diverged, "prompts": len(reference)}


def hits(outputs: list[dict], finals: list[dict], expected_key: str = "expected_cached") -> dict:
    cached = [o["cached_tokens"] for o in outputs]
    expected = [f[expected_key] for f in finals]
    return {"cached": cached, "expected": expected, "all_hit": cached == expected}


def checkpoint_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Llama checkpoint (HF names) and its full, unsharded shape."""
    h, v = config.hidden_size, config.vocab_size
    head = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head, config.num_key_value_heads * head
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
              "lm_head.weight": (v, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (config.intermediate_size, h),
            p + "mlp.up_proj.weight": (config.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, config.intermediate_size),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
    return shapes


def seeded_weights(model) -> int:
    """In each worker: load seeded full tensors through the model's own weight loaders, which
    take this rank's shard; the same tensors on every rank and every TP size."""
    import zlib

    import torch

    def tensors():
        for name, shape in checkpoint_shapes(model.config).items():
            if name.endswith("norm.weight"):
                yield name, torch.ones(shape, dtype=torch.bfloat16, device="cuda")
                continue
            gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(name.encode()))
            full = torch.randn(shape, generator=gen, device="cuda") * 0.02
            yield name, full.to(torch.bfloat16)

    with torch.no_grad():
        return len(model.load_weights(tensors()))


def seed_rank_weights(worker) -> int:
    """Sent to each rank by collective_rpc, which cloudpickles a callable (by value: this
    script is no module the ranks could import)."""
    return seeded_weights(worker.get_model())


def run_engine(spec: dict) -> dict:
    """In this (child) process: one engine, the phase's requests, results as a dict."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from minipic.config import connector_config
    from minipic.connector.store.settle import wait_until_settled
    from minipic.devtools.llama3_8b import MARKERS

    phase, load = spec["phase"], spec["prompts"]
    extra = {"store_dir": spec["store"], "cpu_bytes": 4 << 30, **MARKERS}
    llm = LLM(model=spec["model"], load_format="dummy", skip_tokenizer_init=True,
              dtype="bfloat16", block_size=BLOCK_SIZE, max_model_len=4096,
              max_num_batched_tokens=4096, gpu_memory_utilization=0.85, enforce_eager=True,
              enable_prefix_caching=True, seed=0, tensor_parallel_size=TP_OF[phase],
              disable_custom_all_reduce=True,  # NCCL only: one all-reduce path, no IPC buffers
              kv_transfer_config=connector_config(extra))
    loaded = llm.collective_rpc(seed_rank_weights)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True,
                            detokenize=False)
    tokens = lambda prompts: [TokensPrompt(prompt_token_ids=p) for p in prompts]  # noqa: E731

    def finals(kind: str = "finals") -> list[dict]:
        outs = llm.generate(tokens([f["tokens"] for f in load[kind]]), params, use_tqdm=False)
        return [{"tokens": list(o.outputs[0].token_ids), "cached_tokens": o.num_cached_tokens,
                 "lp": [lp[t].logprob for t, lp in
                        zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]} for o in outs]

    result = {"phase": phase, "loaded_tensors_per_rank": loaded}
    if phase == "tp2":
        result["probe"] = finals("probes")  # before any prefill: only the store could serve spans
    if phase != "tp2-reload":
        llm.generate(tokens(load["prefills"]), SamplingParams(max_tokens=1), use_tqdm=False)
    result["finals"] = finals()
    llm.llm_engine.engine_core.shutdown()  # the disk tier finishes its writes
    wait_until_settled(spec["store"], quiet_s=2.0)
    return result


def namespaces(store: str) -> list[dict]:
    """The store's namespaces: which TP size each names, blocks stored, blocks loaded."""
    from minipic.connector.store.stats import scan_store

    if not os.path.isdir(store):
        return []
    return [{"namespace": Path(ns.path).name, "tp": find_key(ns.fields, "tensor_parallel_size"),
             "blocks": ns.blocks, "loaded_blocks": ns.counters.get("hit_blocks", 0)}
            for ns in scan_store(store)]


def find_key(tree, key: str):
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        tree = list(tree.values())
    if isinstance(tree, list):
        return next((v for v in (find_key(t, key) for t in tree) if v is not None), None)
    return None


def model_dir(shape: str, root: Path) -> str:
    from minipic.devtools import llama3_8b

    path = llama3_8b.write_config(root / shape)
    config = dict(llama3_8b.CONFIG, **SHAPES[shape])
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def run_child(spec: dict, work: Path) -> dict:
    """One engine in its own process, seeing one GPU (TP=1) or both (TP=2)."""
    spec_file, out = work / f"{spec['name']}.json", work / f"{spec['name']}.out.json"
    spec_file.write_text(json.dumps(spec))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0" if TP_OF[spec["phase"]] == 1 else "0,1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0",  # engine core in the child itself
               HF_HUB_OFFLINE="1", **NO_MULTICAST)
    proc = subprocess.run([sys.executable, __file__, "--out", str(out), "--child",
                           str(spec_file)], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not out.exists():
        return {"phase": spec["phase"], "error": (proc.stdout[-2000:] + proc.stderr[-4000:])}
    return json.loads(out.read_text())


def run_shape(shape: str, phases: list[str], prompts: dict, root: Path) -> dict:
    model, store = model_dir(shape, root), str(root / f"store-{shape}")
    report = {"shape": shape, "phases": {}}
    for phase in phases:
        spec = {"name": f"{shape}-{phase}", "phase": phase, "model": model, "store": store,
                "prompts": prompts}
        result = run_child(spec, root)
        result["namespaces_after"] = namespaces(store)
        report["phases"][phase] = result
    return summarise(report, prompts["finals"])


def summarise(report: dict, finals: list[dict]) -> dict:
    done = {k: v for k, v in report["phases"].items() if "error" not in v}
    for phase, result in done.items():
        # tp2-reload sends the finals tp2 stored: all of each prompt comes from the store.
        expected = "expected_rerun" if phase == "tp2-reload" else "expected_cached"
        result["hits"] = hits(result["finals"], finals, expected)
        if "probe" in result:
            result["probe_cached_tokens"] = [o["cached_tokens"] for o in result["probe"]]
    if "tp1" in done:
        for phase in ("tp2", "tp2-reload"):
            if phase in done:
                report[f"{phase}_vs_tp1"] = compare(done["tp1"]["finals"], done[phase]["finals"])
    return report


def markdown(results: list[dict]) -> str:
    lines = ["| shape | phase | cached / expected (final prompts) | all hit | "
             "max abs logprob diff vs tp1 (tokens) | store namespaces after (tp: blocks, loaded) |",
             "|---|---|---|---|---|---|"]
    for r in results:
        for phase, p in r["phases"].items():
            if "error" in p:
                lines.append(f"| {r['shape']} | {phase} | error | | | |")
                continue
            c = r.get(f"{phase}_vs_tp1", {})
            ns = ", ".join(f"{n['tp']}: {n['blocks']}, {n['loaded_blocks']}"
                           for n in p["namespaces_after"])
            diff = f"{c['max_abs_logprob_diff']} ({c['compared_tokens']})" if c else "-"
            probe = f"; probe {p['probe_cached_tokens']}" if "probe_cached_tokens" in p else ""
            lines.append(f"| {r['shape']} | {phase} | {p['hits']['cached']} / "
                         f"{p['hits']['expected']}{probe} | {p['hits']['all_hit']} | {diff} | "
                         f"{ns} |")
    return "\n".join(lines) + "\n"


def headline(results: list[dict]) -> float | None:
    diffs = [r["tp2_vs_tp1"]["max_abs_logprob_diff"] for r in results if "tp2_vs_tp1" in r]
    diffs = [d for d in diffs if d is not None]
    return max(diffs) if diffs else None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:  # one engine; --out is its result file
        args.out.write_text(json.dumps(run_engine(json.loads(args.child.read_text()))))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = build_prompts(args.docs, args.doc_tokens, args.finals)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            results.append(run_shape(shape, args.phases, prompts, Path(tmp)))
            summary = {"tp2_max_logprob_diff_vs_tp1": headline(results), "results": results,
                       "args": {k: str(v) for k, v in vars(args).items()}}
            (args.out / "bench_tp.json").write_text(json.dumps(summary, indent=1))
            (args.out / "bench_tp.md").write_text(markdown(results))
    print((args.out / "bench_tp.md").read_text())
    print("tp2_max_logprob_diff_vs_tp1:", headline(results))
    failed = [(r["shape"], phase, p["error"]) for r in results for phase, p in r["phases"].items()
              if "error" in p]
    for shape, phase, error in failed:
        print(f"--- {shape} {phase} failed:\n{error}", file=sys.stderr)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
