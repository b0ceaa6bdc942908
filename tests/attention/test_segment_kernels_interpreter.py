"""The turn and merge kernels around FlashAttention rows (segment_kernels.py) under the Triton
interpreter (CPU CI), against their torch versions on an EPIC batch's plan.

As in test_triton_kernel_interpreter.py, the kernels run in child processes that set
TRITON_INTERPRET=1 before triton is imported; each prints one JSON line of errors for the
cases named on its command line. One child per case, all at once (the interpreter keeps a
core busy each).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# (make_case kwargs): neox fp32, 6 heads, GPT-J with partial rotary fp16
CASES = {
    "neox_fp32": dict(num_q_heads=4, num_kv_heads=2, head_size=32, dtype="float32"),
    # a head count off the power of two: the kernels' masked head lanes
    "neox_6_heads_fp32": dict(num_q_heads=6, num_kv_heads=3, head_size=32, dtype="float32"),
    "gptj_partial_fp16": dict(num_q_heads=4, num_kv_heads=1, head_size=64, rotary_dim=32,
                              is_neox=False, dtype="float16"),
}
TOLERANCE = {"float32": 1e-5, "float16": 2e-3}


def _errors(name: str) -> dict[str, float]:
    import torch

    from minipic.attention.rotation import Rotation
    from minipic.attention.segment_attention import (merge, paged_flash_reference, prepare,
                                                     segment_attention)
    from minipic.attention.segment_kernels import merge_rows, turn_rows, turn_rows_and_keys
    from minipic.attention import segment_plan as segment_plan_module
    from minipic.attention.segment_plan import segment_plan
    from minipic.devtools.paged_attention_case import (epic_markers, make_case,
                                                       reference_attention, relative_error)

    kwargs = dict(CASES[name])
    kwargs["dtype"] = getattr(torch, kwargs["dtype"])
    case = make_case([16 * 3 + 5, 1], [16 + 3 * 48, 16 + 2 * 32 + 32 + 20],
                     markers=[epic_markers(3, 3, 1, 2), epic_markers(2, 2, 1, 3)], **kwargs)
    # The two-call path (the causal rows apart), whose merge of two calls this checks; the
    # one-call path's merge is _graph_errors'.
    segment_plan_module.JOINT_OWN_KEYS = 0
    plan = segment_plan(case.layout, case.cu_seqlens_q.tolist(), case.seq_lens.tolist(), 16)
    batch = prepare(plan, case.block_table, case.cos_sin, case.rotary_dim, case.is_neox)
    q = case.q
    by_kernel = turn_rows(q, batch.turn_index, batch.turn.cos, batch.turn.sin,
                          case.rotary_dim, case.is_neox)
    by_torch = batch.turn.apply(q.index_select(0, batch.turn_index)).to(q.dtype)
    # The K turn before the cache write: token i by its own amount, no index.
    keys = Rotation.back(torch.arange(q.shape[0] - 3) * 7, case.cos_sin, case.rotary_dim,
                         case.is_neox)
    keys_by_kernel = turn_rows(q, None, keys.cos, keys.sin, case.rotary_dim, case.is_neox)
    keys_by_torch = keys.apply(q[: q.shape[0] - 3]).to(q.dtype)
    # Both in one launch, the keys with their own head count (the cache's).
    k = case.k_cache.flatten(0, 1)[: q.shape[0]]
    both_q, both_k = turn_rows_and_keys(q, batch.turn_index, batch.turn.cos, batch.turn.sin,
                                        case.rotary_dim, case.is_neox, k, keys.cos, keys.sin)
    k_by_torch = keys.apply(k[: q.shape[0] - 3]).to(q.dtype)

    flash = functools.partial(paged_flash_reference, scale=case.scale)
    n = q.shape[0]
    own_q = by_torch[:n] if batch.own_turned else q
    own_out, own_lse = flash(own_q, case.k_cache, case.v_cache, plan.own, batch.own_table,
                             causal=True)
    earlier_q = by_torch[n:] if batch.own_turned else by_torch
    earlier_out, earlier_lse = flash(earlier_q, case.k_cache, case.v_cache, plan.earlier,
                                     batch.earlier_table, causal=False)
    merged_kernel = merge_rows(torch.empty_like(q), own_out, own_lse, earlier_out, earlier_lse,
                               plan.merge_starts, plan.merge_entries)
    merged_torch = merge(torch.empty_like(q), own_out, own_lse, earlier_out, earlier_lse,
                         plan.earlier.query_index)
    whole = torch.empty_like(q)
    segment_attention(q, case.k_cache, case.v_cache, whole, batch, flash)
    return {**_graph_errors(kwargs), **_many_rows_errors(kwargs),
            "turn": relative_error(by_kernel, by_torch),
            "turn_keys": relative_error(keys_by_kernel, keys_by_torch),
            "turn_both_queries": relative_error(both_q, by_torch),
            "turn_both_keys": relative_error(both_k, k_by_torch),
            "merge": relative_error(merged_kernel, merged_torch),
            "merge_vs_reference": relative_error(merged_kernel, reference_attention(case)),
            "torch_path_vs_reference": relative_error(whole, reference_attention(case))}


def _graph_errors(kwargs: dict) -> dict[str, float]:
    """A full decode graph's batch (graph_rows.py), two padding requests: the turn
    stops at its row count, the merge gives padding (rows without keys, whose LSE FA3
    gives as -inf and FA2 as +inf) 0."""
    import torch

    from minipic.attention.graph_rows import GraphRows, GraphShape
    from minipic.attention.segment_attention import paged_flash_reference
    from minipic.attention.segment_kernels import merge_rows, turn_rows_and_keys
    from minipic.attention.segment_plan import segment_plan
    from minipic.devtools.paged_attention_case import (reference_attention, relative_error,
                                                       shared_documents_case)

    case = shared_documents_case(**kwargs)
    n, padded = case.q.shape[0], case.q.shape[0] + 2
    plan = segment_plan(case.layout, case.cu_seqlens_q.tolist(), case.seq_lens.tolist(), 16)
    table = torch.zeros(padded, case.block_table.shape[1], dtype=case.block_table.dtype)
    table[:n] = case.block_table
    rows = GraphRows(padded, 0, table.shape[1], 4096, case.rotary_dim, case.is_neox,
                     torch.device("cpu"))
    batch, _ = rows.fill(GraphShape(padded), plan, case.seq_lens.tolist(), None, table, 16,
                         case.cos_sin)
    q = torch.cat([case.q, torch.randn(2, *case.q.shape[1:]).to(case.q.dtype)])
    used = int(batch.turn_count)
    by_kernel, _ = turn_rows_and_keys(q, batch.turn_index, batch.turn.cos, batch.turn.sin,
                                      case.rotary_dim, case.is_neox, row_count=batch.turn_count)
    by_torch = batch.turn.apply(q.index_select(0, batch.turn_index)).to(q.dtype)
    out, lse = paged_flash_reference(by_torch, case.k_cache, case.v_cache, batch.plan.joint,
                                     batch.joint_table, causal=False, scale=case.scale)
    merged = {}
    for name, padding_lse in (("fa3", float("-inf")), ("fa2", float("inf"))):
        lse[:, n:padded] = padding_lse
        merged[name] = merge_rows(torch.empty_like(q), out[:padded], lse[:, :padded],
                                  out[padded:], lse[:, padded:], batch.plan.merge_starts,
                                  batch.plan.merge_entries)
    # as segment_attention merges one call's output on CUDA: both kinds of rows in it, the
    # earlier ones from row `padded` on (no views); the padding's rows at FA2's +inf
    joint = merge_rows(torch.empty_like(q), out, lse, out, lse, batch.plan.merge_starts,
                       batch.plan.merge_entries, earlier_offset=padded)
    return {"graph_turn": relative_error(by_kernel[:used], by_torch[:used]),
            "graph_merge_vs_reference": relative_error(merged["fa3"][:n],
                                                       reference_attention(case)),
            "graph_merge_one_output": relative_error(joint, merged["fa2"]),
            "graph_padding": max(float(m[n:].float().abs().max()) for m in merged.values())}


def _many_rows_errors(kwargs: dict) -> dict[str, float]:
    """merge_rows against torch's merge in both launch shapes (merge_launch_shape): tokens
    with more earlier rows than a program loads at once (a 40-document hit's question has
    41), with none, with rows without keys (FA3's -inf, FA2's +inf LSE), and with rows
    that all lack keys; a token's rows not side by side."""
    import torch

    from minipic.attention import segment_kernels

    generator = torch.Generator().manual_seed(0)
    heads, d, dtype = kwargs["num_q_heads"], kwargs["head_size"], kwargs["dtype"]
    block = segment_kernels.MERGE_ROWS_BLOCK
    counts = torch.tensor([0, 1, block, block + 1, 2 * block + 9, 3, 2])
    errors = {}
    split = segment_kernels.MERGE_SPLIT_HEADS_BELOW
    try:
        # the second shape (a long chunk's) for these few tokens: the split moved below them
        for name, split_below in (("merge_many_rows", split), ("merge_many_tokens", 1)):
            segment_kernels.MERGE_SPLIT_HEADS_BELOW = split_below
            errors[name] = _merge_error(counts, heads, d, dtype, generator)
    finally:
        segment_kernels.MERGE_SPLIT_HEADS_BELOW = split
    return errors


def _merge_error(counts, heads: int, d: int, dtype, generator) -> float:
    """merge_rows against torch's merge for tokens with `counts` earlier rows each."""
    import torch

    from minipic.attention.segment_attention import merge
    from minipic.attention.segment_kernels import merge_rows
    from minipic.devtools.paged_attention_case import relative_error

    n, m = counts.numel(), int(counts.sum())
    token = torch.repeat_interleave(torch.arange(n), counts)[
        torch.randperm(m, generator=generator)]
    entries = torch.argsort(token, stable=True).to(torch.int32)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    own_out, earlier_out = (torch.randn(k, heads, d, generator=generator).to(dtype)
                            for k in (n, m))
    own_lse = torch.randn(heads, n, generator=generator) * 3
    earlier_lse = torch.randn(heads, m, generator=generator) * 3
    own_lse[:, 0] = float("-inf")  # token 0: no keys at all, so 0
    earlier_lse[:, int(entries[5])] = float("-inf")  # one of token 2's rows: no keys
    earlier_lse[:, int(entries[40])] = float("inf")  # one of token 4's (FA2's no keys)
    own_lse[:, 6] = float("inf")  # token 6: its own row and both earlier rows lack keys
    earlier_lse[:, entries[starts[6]:starts[7]].long()] = float("-inf")
    by_kernel = merge_rows(torch.empty(n, heads, d, dtype=dtype), own_out, own_lse,
                           earlier_out, earlier_lse, starts, entries)
    by_torch = merge(torch.empty(n, heads, d, dtype=dtype), own_out, own_lse, earlier_out,
                     earlier_lse, token)
    return relative_error(by_kernel, by_torch)


def _start_up_variants(kwargs: dict, max_tokens: int) -> list:
    """The (kernel, constexprs) pairs compile_variants launches for a case's shapes."""
    import torch

    from minipic.attention import segment_kernels

    seen = []
    original = segment_kernels.launch

    def recording(kernel, grid, bind, tensors, fixed, launches, name):
        seen.append([name, dict(sorted(bind(*tensors)[1].items()))])
        return original(kernel, grid, bind, tensors, fixed, launches, name)

    segment_kernels.launch = recording
    try:
        segment_kernels.compile_variants.__wrapped__(  # past functools.cache: each case's own
            kwargs["num_q_heads"], kwargs["num_kv_heads"], kwargs["head_size"],
            getattr(torch, kwargs["dtype"]), kwargs.get("rotary_dim", kwargs["head_size"]),
            kwargs.get("is_neox", True), torch.device("cpu"), max_tokens)
    finally:
        segment_kernels.launch = original
    return seen


@pytest.fixture(scope="module")
def interpreter_errors() -> dict:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    children = [subprocess.Popen([sys.executable, __file__, case_name], env=env, cwd=REPO,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for case_name in CASES]
    results: dict = {"variants": {}}
    for child in children:
        out, err = child.communicate(timeout=600)
        assert child.returncode == 0, err[-4000:]
        child_results = json.loads(out.strip().splitlines()[-1])
        results["variants"].update(child_results.pop("variants"))
        results.update(child_results)
    return results


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("check", ["turn", "turn_keys", "turn_both_queries", "turn_both_keys",
                                   "merge", "merge_many_rows", "merge_many_tokens",
                                   "merge_vs_reference", "torch_path_vs_reference",
                                   "graph_turn", "graph_merge_vs_reference",
                                   "graph_merge_one_output", "graph_padding"])
def test_kernels_match_torch(interpreter_errors, name, check):
    err = interpreter_errors[name]
    assert isinstance(err, dict), err  # the child reports an exception as text
    assert err[check] < TOLERANCE[CASES[name]["dtype"]], err


@pytest.mark.parametrize("name", sorted(CASES))
def test_start_up_compiles_each_variant_a_span_batch_launches(interpreter_errors, name):
    """compile_variants (run when a FlashAttention span builder starts) launches the turn
    as segment_attention._turned does, with new keys and without, and for the new keys
    alone, and the merge in each launch shape (merge_launch_shape) the engine's batch
    limit can reach."""
    by_limit = interpreter_errors["variants"][name]
    assert isinstance(by_limit, dict), by_limit
    seen = by_limit["16384"]
    case = CASES[name]
    heads, kv_heads = case["num_q_heads"], case["num_kv_heads"]
    turns = {(c["HEADS"], c["K_HEADS"], c["HAS_INDEX"], c["HAS_KEYS"], c["HAS_COUNT"])
             for kind, c in seen if kind == "turn"}
    assert turns == {(heads, kv_heads, True, True, False),  # queries and new keys
                     (heads, heads, True, False, False),  # queries alone
                     (kv_heads, kv_heads, False, False, False)}  # new keys alone
    merges = {(c["HEADS_BLOCK"], c["ROWS_BLOCK"]) for kind, c in seen if kind == "merge"}
    assert merges == {(1, 16), (1 << (heads - 1).bit_length(), 1)}
    # an engine of 8 batched tokens never reaches the many-token shape: not compiled
    assert {(c["HEADS_BLOCK"], c["ROWS_BLOCK"]) for kind, c in by_limit["8"]
            if kind == "merge"} == {(1, 16)}


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest (sets TRITON_INTERPRET=1)"
    results: dict = {"variants": {}}
    for case_name in sys.argv[1:]:
        try:
            results[case_name] = _errors(case_name)
        except Exception as exc:  # report, so the other case still runs
            results[case_name] = f"{type(exc).__name__}: {exc}"
        try:
            results["variants"][case_name] = {
                str(tokens): _start_up_variants(CASES[case_name], tokens) for tokens in (16384, 8)}
        except Exception as exc:
            results["variants"][case_name] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(results))
