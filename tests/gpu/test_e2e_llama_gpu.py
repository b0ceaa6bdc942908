"""End to end on the GPU: a Llama-3-8B-shaped model gives the same logprobs with minipic on and off,
and span prompts the same answers on FlashAttention rows as on minipic's Triton kernel.

No markers in the prompts, so minipic must be invisible: its backend hands such
batches to FlashAttention as stock vLLM does (keys stored at their positions),
so the teacher-forced prompt logprobs and greedy continuations are stock's, also
when the second round hits the prefix cache. Weights are random
(no hub): vLLM's dummy loader, then a seeded normal(0, 0.02) re-init so the
attention pattern and the logits are far from uniform (the dummy values alone,
norms included, are +-1e-3 and flatten everything).

With minipic on, each run also sends span prompts (Block-Attention and EPIC, their
spans prefilled first so the final prompts hit them): the default attends those
batches as FlashAttention rows merged by log-sum-exp, `on_spans_triton` with minipic's
span kernel; the two must agree as closely as two stock backends do.

Each configuration runs in its own child process with the plugin discoverable
through a temporary entry point (as `pip install` would make it) and vLLM's
engine in-process, so the weight re-init needs no RPC serialisation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minipic.devtools.llama3_8b import MARKERS, write_config
from minipic.devtools.plugin_site import REPO, plugin_env
from minipic.devtools.span_paths import count_span_paths

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MINIPIC = {"minipic": MARKERS}
PROMPT_LENS = [600, 1500, 37, 3000]  # the 3000-token prompt is prefilled in chunks
SHARED_PREFIX = 512  # prompts 1 and 3 start like prompt 0: cached-prefix attention
MAX_TOKENS = 16
RUNS = {
    "off_eager": dict(enforce_eager=True),  # vLLM's default on H100/H200: FlashAttention 3
    # A second stock backend: how far two correct kernels drift apart on this model.
    "off_triton": dict(enforce_eager=True, attention_config={"backend": "TRITON_ATTN"}),
    "on_eager": dict(enforce_eager=True, additional_config=MINIPIC),
    # torch.compile, piecewise CUDA graphs, full graphs of decode steps over span prompts
    # and (option prefill_graphs) of a span hit's question (the rows path from
    # fixed-capacity buffers: graph_rows.py); 48 holds the "alone" hit's 41 computed tokens
    "on_compiled": dict(additional_config={"minipic": {**MARKERS, "prefill_graphs": True}},
                        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 48]}),
    # span batches on minipic's Triton kernel instead of FlashAttention rows
    "on_spans_triton": dict(enforce_eager=True,
                            additional_config={"minipic": {**MARKERS, "span_attention": "triton"}}),
    # the V1 model runner: span layouts from its host token table, where Model Runner V2
    # (vLLM 0.25's default) reads them from minipic's host copy of the prompts
    "on_v1_runner": dict(enforce_eager=True, additional_config=MINIPIC),
}
RUN_ENV = {"on_v1_runner": {"VLLM_USE_V2_MODEL_RUNNER": "0"}}
BLOCK_SIZE = 16  # vLLM's default on CUDA


def _span_prompts() -> list:
    """Block-Attention and EPIC prompts over random documents (token ids)."""
    from minipic.client.prompts.recipes import RECIPES_BY_NAME
    from minipic.protocol import SpanProtocol

    gen = torch.Generator().manual_seed(1)

    def tokens(n):
        return torch.randint(0, 128000, (n,), generator=gen).tolist()

    protocol = SpanProtocol(**MARKERS)
    docs = [tokens(n) for n in (300, 170, 450, 90)]
    prompts = [RECIPES_BY_NAME[name](docs[i:] + docs[:i], tokens(40), protocol=protocol,
                                     block_size=BLOCK_SIZE, system=tokens(20))
               for i, name in enumerate(("block_attention", "epic", "epic2"))]
    # the first prompt's documents under a system and question of its own: the "alone"
    # hit (_span_answers), which then hits its prefills (its header, the shared documents)
    # and nothing else
    alone = RECIPES_BY_NAME["block_attention"](docs, tokens(40), protocol=protocol,
                                               block_size=BLOCK_SIZE, system=tokens(20))
    return prompts + [alone]


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128000, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    for i in (1, 3):
        prompts[i][:SHARED_PREFIX] = prompts[0][:SHARED_PREFIX]
    return prompts


def _reinit_weights(model) -> str:
    """Seeded normal(0, 0.02) weights, norms at 1: the same in every run, per parameter name."""
    import zlib

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            gen = torch.Generator(device=param.device).manual_seed(zlib.crc32(name.encode()))
            param.copy_(torch.randn(param.shape, generator=gen, device=param.device) * 0.02)
    impl = next(m.impl for m in model.modules() if hasattr(m, "impl"))
    return type(impl).__name__


def _child(run: str, model_dir: str, out_path: str) -> None:
    """One engine: two rounds of generation, logprobs to JSON."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              block_size=BLOCK_SIZE,
              max_model_len=4096, max_num_batched_tokens=2048, max_num_seqs=8,
              gpu_memory_utilization=0.8, seed=0, **RUNS[run])
    impl = llm.apply_model(_reinit_weights)[0]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in _prompts()]
    first = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1, prompt_logprobs=1,
                           detokenize=False)
    again = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1, detokenize=False)
    result = {"impl": impl}
    for label, params in (("first", first), ("cached", again)):
        result[label] = [_answer(o) for o in llm.generate(prompts, params, use_tqdm=False)]
    if "additional_config" in RUNS[run]:
        calls = count_span_paths()
        result["spans"] = _span_answers(llm, first, again)
        result["span_paths"] = dict(calls)
    Path(out_path).write_text(json.dumps(result))


def _span_answers(llm, with_prompt_logprobs, without) -> dict:
    """Span prompts: spans prefilled alone, then the final prompts as hits ("cached"), once
    more with prompt logprobs ("first"), which vLLM computes without its prefix cache (the
    spans are then computed inside the final prompt), and a fourth Block-Attention prompt
    (the first's documents, a header and question of its own) as a hit alone."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    *prompts, alone = _span_prompts()
    prefill = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    spans = [TokensPrompt(prompt_token_ids=s)
             for p in (*prompts, alone) for s in p.span_prefills]
    llm.generate(spans, prefill, use_tqdm=False)
    answers = {}
    # "alone": a Block-Attention hit in a batch of its own is a short span prefill without
    # links: eager, span_attention "auto" gives it the span kernel; in on_compiled its 41
    # computed tokens replay the prefill graph of 48 (option prefill_graphs); beside the EPIC
    # prompts, the rows.
    # Its question is new: the first prompt's, computed by the rounds before, would be a
    # prefix hit too (two blocks more than its spans).
    for label, params, batch in (("cached", without, prompts), ("first", with_prompt_logprobs,
                                                                prompts),
                                 ("alone", without, [alone])):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p.final) for p in batch], params,
                            use_tqdm=False)
        answers[label] = [dict(_answer(o), expected_cached=p.expected_cached_tokens)
                          for o, p in zip(outs, batch)]
    return answers


def _answer(o) -> dict:
    """One request's teacher-forced prompt logprobs, greedy tokens and their logprobs."""
    return {
        "prompt_lp": [None if lp is None else lp[tok].logprob
                      for tok, lp in zip(o.prompt_token_ids, o.prompt_logprobs or [])],
        "tokens": list(o.outputs[0].token_ids),
        "lp": [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)],
        "cached_tokens": o.num_cached_tokens,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    pytest.importorskip("vllm")
    root = tmp_path_factory.mktemp("e2e")
    model_dir = root / "llama3-8b-shaped"
    model_dir.mkdir()
    write_config(model_dir)
    env = plugin_env(root)
    report = os.environ.get("MINIPIC_E2E_REPORT")  # optional: where to keep the numbers
    results = {}
    # MINIPIC_E2E_RUNS=a,b limits the engines started (each costs about a minute).
    chosen = os.environ.get("MINIPIC_E2E_RUNS")
    for run in chosen.split(",") if chosen else RUNS:
        out = root / f"{run}.json"
        proc = subprocess.run([sys.executable, __file__, run, str(model_dir), str(out)],
                              env={**env, **RUN_ENV.get(run, {})}, cwd=REPO, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{run} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        results[run] = json.loads(out.read_text())
        if report:  # after every run, so a cut-short session keeps what finished
            Path(report).write_text(json.dumps(_summary(results), indent=1))
    return results


def _summary(results: dict) -> dict:
    summary = {run: r["impl"] for run, r in results.items()}
    for a, b in (("off_eager", "off_triton"), ("off_triton", "on_eager"),
                 ("off_triton", "on_compiled"), ("off_eager", "on_eager"),
                 ("off_eager", "on_compiled")):
        if a in results and b in results:
            summary[f"{b}_vs_{a}"] = _compare(results[a], results[b])
    kernel = results.get("on_spans_triton", {}).get("spans")
    for run in ("on_eager", "on_compiled"):
        flash = results.get(run, {}).get("spans")
        if kernel and flash:
            summary[f"spans_{run}_vs_on_spans_triton"] = _compare(kernel, flash)
    if "on_v1_runner" in results and "on_eager" in results:
        summary["spans_on_eager_vs_on_v1_runner"] = _compare(results["on_v1_runner"]["spans"],
                                                             results["on_eager"]["spans"])
    return summary


def _compare(off: dict, on: dict) -> dict:
    """Differences in teacher-forced prompt logprobs and in greedy continuations."""
    diffs, spread = [], []
    for a, b in zip(off["first"], on["first"]):
        pairs = [(x, y) for x, y in zip(a["prompt_lp"], b["prompt_lp"]) if x is not None]
        diffs += [abs(x - y) for x, y in pairs]
        spread += [x for x, _ in pairs]
    mean = sum(spread) / len(spread)
    std = (sum((x - mean) ** 2 for x in spread) / len(spread)) ** 0.5
    diffs.sort()
    out = {"prompt_lp_mean_abs_diff": sum(diffs) / len(diffs),
           "prompt_lp_p99_abs_diff": diffs[int(0.99 * (len(diffs) - 1))],
           "prompt_lp_max_abs_diff": diffs[-1], "prompt_lp_std_across_positions": std}
    labels = [label for label in ("first", "cached", "alone") if label in off and label in on]
    for label in labels:
        out[f"{label}_greedy_equal_prefix"] = [
            next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y),
                 len(a["tokens"])) for a, b in zip(off[label], on[label])]
        out[f"{label}_first_token_lp_diff"] = [abs(a["lp"][0] - b["lp"][0])
                                               for a, b in zip(off[label], on[label])]
    # generated tokens' logprobs (decode steps) while both continuations agree
    decode = []
    for label in labels:
        for a, b, same in zip(off[label], on[label], out[f"{label}_greedy_equal_prefix"]):
            decode += [abs(x - y) for x, y in zip(a["lp"][1:same], b["lp"][1:same])]
    out["decode_lp_compared"] = len(decode)
    out["decode_lp_mean_abs_diff"] = sum(decode) / len(decode) if decode else None
    out["cached_tokens_on"] = [o["cached_tokens"] for o in on["cached"]]
    return out


def _need(runs: dict, *names: str) -> None:
    missing = [n for n in names if n not in runs]
    if missing:
        pytest.skip(f"not run (MINIPIC_E2E_RUNS): {missing}")


@pytest.mark.parametrize("run", ["on_eager", "on_compiled"])
def test_minipic_backend_is_selected(runs, run):
    _need(runs, run, "off_eager")
    assert runs[run]["impl"] == "MiniPICFlashImpl"
    assert runs["off_eager"]["impl"] != "MiniPICFlashImpl"


def test_plain_prompts_are_stock_flash_attention(runs):
    """Eager, no markers: the same kernels on the same inputs as stock vLLM, so the same
    logprobs and tokens, bit for bit."""
    _need(runs, "on_eager", "off_eager")
    s = _compare(runs["off_eager"], runs["on_eager"])
    assert s["prompt_lp_max_abs_diff"] == 0.0, s
    assert all(n == MAX_TOKENS for n in s["first_greedy_equal_prefix"]
               + s["cached_greedy_equal_prefix"]), s


@pytest.mark.parametrize("run", ["on_eager", "on_compiled"])
def test_logprobs_match_minipic_off(runs, run):
    """minipic vs stock Triton differs no more than two stock backends differ from each other
    (compiled, torch.compile's fusions and minipic's piecewise graphs for decode steps
    without markers, where stock FA3 replays full graphs: its numbers need not equal
    stock's bit for bit).

    32 random layers amplify any rounding difference, so the yardstick is measured on the
    same prompts: FA3 against stock Triton.
    """
    _need(runs, run, "off_eager", "off_triton")
    noise = _compare(runs["off_eager"], runs["off_triton"])
    s = _compare(runs["off_triton"], runs[run])
    assert s["prompt_lp_mean_abs_diff"] < 2 * noise["prompt_lp_mean_abs_diff"] + 0.01, (s, noise)
    assert s["prompt_lp_p99_abs_diff"] < 2 * noise["prompt_lp_p99_abs_diff"] + 0.05, (s, noise)
    # A wrong rotation is far outside both: logprobs spread by about 1.3 here.
    assert s["prompt_lp_mean_abs_diff"] < 0.1 * s["prompt_lp_std_across_positions"], s
    assert any(n > 0 for n in s["cached_tokens_on"]), "second round never hit the prefix cache"
    assert s["decode_lp_compared"] > 0, s  # the decode steps' logprobs too
    decode_noise = noise["decode_lp_mean_abs_diff"] or 0.0
    assert s["decode_lp_mean_abs_diff"] < 2 * decode_noise + 0.01, (s, noise)


def test_span_layouts_from_host_prompts_match_the_v1_runner(runs):
    """Model Runner V2 builds span layouts from minipic's host copy of each prompt; the V1
    runner from its own token table. The same span prompts (hits and full prefills) give
    the same answers, as closely as two stock backends agree on plain prompts."""
    _need(runs, "on_eager", "on_v1_runner", "off_eager", "off_triton")
    noise = _compare(runs["off_eager"], runs["off_triton"])
    s = _compare(runs["on_v1_runner"]["spans"], runs["on_eager"]["spans"])
    assert s["prompt_lp_mean_abs_diff"] < 2 * noise["prompt_lp_mean_abs_diff"] + 0.01, (s, noise)
    assert s["prompt_lp_p99_abs_diff"] < 2 * noise["prompt_lp_p99_abs_diff"] + 0.05, (s, noise)
    assert runs["on_eager"]["span_paths"]["rows"] > 0
    # Model Runner V2 shares rows that read the same span tail (a link's and the task's,
    # or two requests'): the requests got span ids, so the scheduler's salt tag reached the
    # worker. The V1 runner has no span ids.
    assert runs["on_eager"]["span_paths"]["shared_plans"] > 0
    assert runs["on_v1_runner"]["span_paths"]["shared_plans"] == 0


if __name__ == "__main__":
    _child(*sys.argv[1:])


@pytest.mark.parametrize("run", ["on_eager", "on_compiled"])
def test_span_prompts_on_flash_rows_match_the_span_kernel(runs, run):
    """The default (span_attention "auto": FlashAttention rows, the span kernel for a short
    span prefill without links, here the Block-Attention hit alone) against minipic's Triton
    span kernel for every span batch, on the same span prompts, every final prompt hitting
    its spans: no further apart than two stock backends on plain prompts."""
    _need(runs, run, "on_spans_triton", "off_eager", "off_triton")
    noise = _compare(runs["off_eager"], runs["off_triton"])
    paths = runs[run]["span_paths"]
    assert paths["rows"] > 0
    # the hit alone: eager on the kernel, compiled in a prefill graph (on the rows)
    assert paths["kernel"] > 0 or run == "on_compiled"
    assert (paths["graph_prefill_steps"] > 0) == (run == "on_compiled")
    assert runs["on_spans_triton"]["span_paths"]["rows"] == 0
    assert runs["on_spans_triton"]["span_paths"]["kernel"] > 0
    flash, kernel = runs[run]["spans"], runs["on_spans_triton"]["spans"]
    for answers in (flash["cached"], kernel["cached"], flash["alone"], kernel["alone"]):
        assert [a["cached_tokens"] for a in answers] == [a["expected_cached"] for a in answers]
    s = _compare(kernel, flash)
    assert s["prompt_lp_mean_abs_diff"] < 2 * noise["prompt_lp_mean_abs_diff"] + 0.01, (s, noise)
    assert s["prompt_lp_p99_abs_diff"] < 2 * noise["prompt_lp_p99_abs_diff"] + 0.05, (s, noise)
    # the hits' first tokens (the alone's: its question's graph, compiled)
    for label in ("cached", "alone"):
        assert max(s[f"{label}_first_token_lp_diff"]) < (
            2 * noise["prompt_lp_p99_abs_diff"] + 0.05), (label, s, noise)
    # the decode steps after the hits (compiled: replayed from full decode graphs)
    assert s["decode_lp_compared"] > 0, s
    decode_noise = noise["decode_lp_mean_abs_diff"] or 0.0
    assert s["decode_lp_mean_abs_diff"] < 2 * decode_noise + 0.01, (s, noise)
    assert (runs[run]["span_paths"]["graph_span_steps"] > 0) == (run == "on_compiled")
