"""Time one attention layer of span batches on one GPU: minipic's two span paths and stock FA3.

Llama-3-8B attention shapes (32 query heads, 8 KV heads, head 128, bf16, block 16), one
paged cache with a shuffled block table. Batches:
  hit10 / hit40   one RAG final prompt after a GPU hit: header, 10 (40) cached documents of
                  1008 tokens as SSep spans, a 50-token PDep task computed (Block-Attention);
  epic10          the same with EPIC: each document's first block recomputed as a link;
  decode256       256 requests decoding one token each over a 4.3k-token span prompt
                  (10 documents of 400 tokens, EPIC links, task);
  final481        the final-prompt step of ISPS at repeat rate 0.9 (tools/bench_rag.py): 481
                  requests, each a 64-token system prompt, 10 cached 96-token documents and
                  a 32-token task computed;
  final481_shared the same, the documents drawn from a pool of 2000 and shared between
                  requests (layout.span_id: one row a document), as the rows would read
                  them with span ids; Model Runner V2 gives ids to decoding rows only, so
                  an engine runs this step as final481 does. Stock vLLM would never share
                  these blocks (its hashes chain through the prefix), so its fa3 time here
                  reads fewer distinct blocks than it would: compare the rows with
                  final481's fa3.
Variants, all on the same cache and queries:
  fa3             stock FlashAttention 3, causal over the same keys: what stock vLLM runs
                  for the same query tokens after its own full prefix hit (the floor);
  flash_rows      minipic's default span path: segment_plan's rows on FA3, merged by LSE
                  (query turns and merge included; `plan_ms`: building the plan on the
                  host and making it ready on the device, once per batch for all layers);
  triton          minipic's Triton span kernel (span_attention="triton").
Times: `*_ms` median of CUDA-event timed launches after warm-up (eager: launch gaps
included); `*_gpu_ms` the call replayed from a CUDA graph (GPU time alone; None if it
cannot be captured); `*_host_us`: the host's time to launch one call (what a host-bound
step pays per layer). Writes results.json and results.md under --out; `--host-profile` adds a
cProfile of each batch's rows path (`host_profile_<batch>.txt`: where its host time goes);
`--kernels` adds each variant's GPU kernels, by time (`kernels_<batch>.txt`: which part of
a path costs what on the GPU).

    tools/gpu_run.sh python3 tools/bench_span_attention.py --out $OUT/span_attention
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import pstats
import time
from pathlib import Path
from typing import NamedTuple

import torch

from minipic.attention import triton_kernel as tk
from minipic.attention.segment_attention import prepare, segment_attention, vllm_flash_rows
from minipic.attention.segment_plan import segment_plan
from minipic.devtools.paged_attention_case import (epic_markers, marker_layout, relative_error,
                                                   rope_table)
from minipic.devtools.timing import gpu_ms

Q_HEADS, KV_HEADS, HEAD, BLOCK = 32, 8, 128, 16
DTYPE = torch.bfloat16


def block_attention_markers(docs: int, doc_blocks: int, task_blocks: int,
                            header_blocks: int = 1) -> str:
    return "-" * header_blocks + ("S" + "-" * (doc_blocks - 1)) * docs \
        + "P" + "-" * (task_blocks - 1)


class Shape(NamedTuple):
    markers: str  # each block's first token (paged_attention_case.make_case's letters)
    requests: int
    query_tokens: int  # per request, the last ones of its sequence
    seq_len: int
    # requests' documents drawn from this many (shared keys and span ids); None: own blocks
    pool: int | None = None


# The final prompts of tools/bench_rag.py (rag_workload.py): a 64-token system prompt, 10
# documents of 95 tokens after their SSep, and a 31-token task after its PDep, computed.
RAG_FINAL = Shape(block_attention_markers(10, 6, 2, header_blocks=4), 481, 32, 64 + 10 * 96 + 32)
BATCHES = {
    "hit10": Shape(block_attention_markers(10, 63, 4), 1, 50, 16 + 10 * 1008 + 50),
    "hit40": Shape(block_attention_markers(40, 63, 4), 1, 50, 16 + 40 * 1008 + 50),
    "epic10": Shape(epic_markers(10, 63, 1, 4), 1, 160 + 50, 16 + 10 * 1008 + 160 + 50),
    "decode256": Shape(epic_markers(10, 25, 1, 6), 256, 1, 16 + 10 * 400 + 160 + 90),
    "final481": RAG_FINAL,
    "final481_shared": RAG_FINAL._replace(pool=2000),
}


class Batch:
    def __init__(self, name: str, gen: torch.Generator) -> None:
        markers, reqs, q_len, seq_len, pool = BATCHES[name]
        blocks = -(-seq_len // BLOCK)
        assert len(markers) >= blocks, name
        markers = markers[:blocks]
        total = reqs * blocks
        self.k = torch.randn(total, BLOCK, KV_HEADS, HEAD, device="cuda", dtype=DTYPE)
        self.v = torch.randn_like(self.k)
        span_id = None
        if pool is None:
            table = torch.randperm(total, generator=gen).view(reqs, blocks)
        else:
            table, span_id = shared_documents(reqs, markers, pool, gen)
        self.table = table.to("cuda", torch.int32)
        self.q = torch.randn(reqs * q_len, Q_HEADS, HEAD, device="cuda", dtype=DTYPE)
        self.cu = torch.arange(reqs + 1, device="cuda", dtype=torch.int32) * q_len
        self.seq_lens = torch.full((reqs,), seq_len, device="cuda", dtype=torch.int32)
        self.q_len, self.seq_len = q_len, seq_len
        self.layout_host = marker_layout([markers] * reqs, blocks, BLOCK)
        self.layout_host.span_id = span_id
        self.layout = self.layout_host.to("cuda")
        self.cos_sin = rope_table(HEAD, 2 * seq_len + 64, device="cuda")
        self.scale = HEAD ** -0.5

    def plan(self):
        qsl = self.cu.tolist()
        plan = segment_plan(self.layout_host, qsl, self.seq_lens.tolist(), BLOCK)
        return prepare(plan, self.table, self.cos_sin, HEAD, True)


def shared_documents(reqs: int, markers: str, pool: int, gen: torch.Generator
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's documents drawn (distinct) from `pool` documents of `doc_blocks`
    blocks each: the block table [reqs, blocks] (a document's blocks are the same cache
    blocks in every request that holds it, every other block is its own; shuffled over the
    cache as the other batches' tables are) and span ids as Model Runner V2 gives a
    decoding row (span_identity.py: the document's first id plus the block's place in it,
    -1 elsewhere)."""
    blocks, starts = len(markers), [i for i, c in enumerate(markers) if c == "S"]
    # every document as long as the first: up to the next marker block
    doc_blocks = next(i for i in range(starts[0] + 1, blocks) if markers[i] != "-") - starts[0]
    in_doc = torch.zeros(blocks, dtype=torch.bool)
    for start in starts:
        in_doc[start: start + doc_blocks] = True
    own = int((~in_doc).sum())
    assert pool * doc_blocks + reqs * own <= reqs * blocks, "the cache is too small"
    span_id = torch.full((reqs, blocks), -1, dtype=torch.int64)
    place = torch.arange(doc_blocks)
    for r in range(reqs):
        docs = torch.randperm(pool, generator=gen)[: len(starts)]
        for start, doc in zip(starts, docs.tolist()):
            span_id[r, start: start + doc_blocks] = doc * doc_blocks + place
    # Cache block numbers before the shuffle: a document block's is its span id (ids are
    # distinct per document and place), the others' follow the documents'.
    unshuffled = span_id.clone()
    unshuffled[:, ~in_doc] = (pool * doc_blocks + torch.arange(reqs * own)).view(reqs, own)
    shuffle = torch.randperm(reqs * blocks, generator=gen)
    return shuffle[unshuffled], span_id


def launchers(b: Batch, out: torch.Tensor) -> dict:
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    batch = b.plan()
    split = tk.split_kv_buffers(tk.SPLIT_KV_MAX_TOKENS, Q_HEADS, HEAD, "cuda")
    launches: dict = {}  # bound at the first call, as an engine's batch binds its first layer

    def fa3():
        flash_attn_varlen_func(q=b.q, k=b.k, v=b.v, max_seqlen_q=b.q_len, cu_seqlens_q=b.cu,
                               max_seqlen_k=b.seq_len, seqused_k=b.seq_lens,
                               softmax_scale=b.scale, causal=True, block_table=b.table,
                               out=out, fa_version=3)

    def flash_rows():
        segment_attention(b.q, b.k, b.v, out, batch,
                          functools.partial(vllm_flash_rows, scale=b.scale, fa_version=3))

    def triton():
        tk.unified_attention_rope(
            b.q, b.k, b.v, out, cu_seqlens_q=b.cu, seqused_k=b.seq_lens,
            max_seqlen_q=b.q_len, block_table=b.table, softmax_scale=b.scale,
            cos_sin=b.cos_sin, rotary_dim=HEAD, is_neox_style=True, split_output=split[0],
            split_max=split[1], split_expsum=split[2],
            seq_threshold_3d=tk.MIN_GRID_2D // KV_HEADS, launches=launches,
            **tk.span_table_args(b.layout, BLOCK))

    return {"fa3": fa3, "flash_rows": flash_rows, "triton": triton}


def time_ms(fn, repeats: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def host_us(fn, repeats: int = 50) -> float:
    """Host time of one call: launches only, timed from an idle GPU, never waiting for it
    (repeats x launches stay far below the launch queue's depth)."""
    fn()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(repeats):
        fn()
    elapsed = time.perf_counter() - began
    torch.cuda.synchronize()
    return elapsed / repeats * 1e6


def plan_ms(b: Batch, repeats: int = 20) -> float:
    b.plan()
    began = time.perf_counter()
    for _ in range(repeats):
        b.plan()
    torch.cuda.synchronize()
    return (time.perf_counter() - began) / repeats * 1e3


def host_profile(fn, repeats: int = 50) -> str:
    """cProfile's listing of `repeats` calls, by time spent in each function itself (as
    host_us: few enough that the launches never wait for the GPU's queue)."""
    fn()
    torch.cuda.synchronize()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(repeats):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
    return f"{repeats} calls\n" + text.getvalue()


def kernel_table(fn, repeats: int = 20) -> str:
    """torch.profiler's CUDA kernels of `repeats` calls, by total GPU time."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    return f"{repeats} calls\n" + prof.key_averages().table(
        sort_by="device_time_total", row_limit=12, max_name_column_width=60)


def measure(name: str, out_dir: Path, host_profile_too: bool = False, kernels_too: bool = False
            ) -> dict:
    b = Batch(name, torch.Generator().manual_seed(0))
    outs, row = {}, {"batch": name, "requests": b.cu.numel() - 1, "query_tokens": b.q.shape[0],
                     "seq_len": b.seq_len}
    variants = launchers(b, out := torch.empty_like(b.q))
    if host_profile_too:
        (out_dir / f"host_profile_{name}.txt").write_text(host_profile(variants["flash_rows"]))
    if kernels_too:
        (out_dir / f"kernels_{name}.txt").write_text("\n\n".join(
            f"## {variant}\n{kernel_table(fn)}" for variant, fn in variants.items()))
    for variant, fn in variants.items():
        row[f"{variant}_ms"] = round(time_ms(fn), 4)
        outs[variant] = out.clone()
        gpu, graphed = gpu_ms(fn)
        row[f"{variant}_gpu_ms"] = round(gpu, 4) if graphed else None
        row[f"{variant}_host_us"] = round(host_us(fn), 1)
    row["plan_ms"] = round(plan_ms(b), 3)
    row["flash_rows_vs_triton_error"] = relative_error(outs["flash_rows"], outs["triton"])
    row["flash_rows_vs_fa3"] = round(row["flash_rows_ms"] / row["fa3_ms"], 3)
    row["triton_vs_fa3"] = round(row["triton_ms"] / row["fa3_ms"], 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", nargs="*", default=sorted(BATCHES))
    parser.add_argument("--host-profile", action="store_true",
                        help="cProfile each batch's rows path into --out")
    parser.add_argument("--kernels", action="store_true",
                        help="each variant's GPU kernels by time, into --out")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.batches:
        rows.append(measure(name, args.out, args.host_profile, args.kernels))
        print(json.dumps(rows[-1]), flush=True)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    (args.out / "results.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    (args.out / "results.md").write_text(f"{env['gpu']}, eager (`*_gpu_ms`: "
                                        "replayed from a CUDA graph)\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
