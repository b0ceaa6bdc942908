"""Time minipic's Triton attention against stock vLLM attention on one GPU.

Llama-3-8B attention shapes (32 query heads, 8 KV heads, head 128, bf16,
block 16). Every variant reads the same paged cache through a shuffled block
table, keys rotated at their positions (stock vLLM's cache, and minipic's for keys
whose frame offset is 0):

  stock         vLLM's Triton `unified_attention` (the TRITON_ATTN backend's kernel)
  stock_again   the same, timed a second time: the noise floor of a ratio
  minipic       minipic's span kernel with default configs and span tables whose frame
                offsets are all 0: the work of a batch with markers (every K tile turned
                by its frame offsets, span and link rules applied)
  minipic_noseg the same kernel without the tables (HAS_SPAN_TABLES compiled out: no
                rotation, plain causal attention)
  minipic_m16   (prefill) minipic at the stock kernel's tile shape (16 rows x 32 keys)
  m16_noseg     (prefill) the same without tables
  fa3           FlashAttention 3 from vLLM's bundle (`flash_attn_varlen_func`, fa_version=3):
                what minipic's backend runs for a batch without markers

Each launch is captured in a CUDA graph and timed with `triton.testing.do_bench`
(median; the L2 cache is flushed before every run). Outputs: results.json,
results.md (tables of times and ratios) and ratio.png (every kernel over FA3,
minipic/devtools/kernel_plot.py) under --out.

    python tools/bench_kernel.py --out out/bench
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch
import triton

from minipic.attention import triton_kernel as tk
from minipic.attention.rotation import rotate
from minipic.attention.span_layout import SpanLayout
from minipic.devtools.kernel_plot import plot
from minipic.devtools.paged_attention_case import relative_error, rope_table
from minipic.devtools.timing import gpu_ms

Q_HEADS, KV_HEADS, HEAD, BLOCK = 32, 8, 128, 16
DTYPE = torch.bfloat16
SEQ_THRESHOLD_3D = 16  # what vLLM's Triton builder picks for 8 KV heads (128 // 8)
PREFILL = [1024, 2048, 4096, 8192, 16384, 32768]
DECODE_BATCHES = [1, 4, 16, 64, 256]
DECODE_CONTEXTS = [1024, 4096, 16384, 32768]
# Tile-shape sweeps (--sweep, --decode-sweep): (block_m, tile, warps, stages, prefetch)
SWEEP = [tk.LaunchConfig(m, t, w, s, prefetch=p) for m, t, w, s, p in
         [(64, 32, 4, 3, False), (64, 64, 4, 3, False), (128, 32, 8, 3, False),
          (128, 64, 8, 3, False), (128, 64, 8, 2, False), (128, 128, 8, 2, False),
          (128, 64, 8, 3, True), (128, 64, 8, 2, True)]]
DECODE_SWEEP = [tk.LaunchConfig(m, t, w, s, prefetch=p) for m, t, w, s, p in
                [(16, 16, 4, 3, False), (16, 16, 4, 3, True), (16, 32, 4, 3, False),
                 (16, 32, 4, 3, True), (16, 16, 2, 3, True), (16, 64, 4, 3, True)]]
# Short queries over long contexts (--short-sweep; a span hit's final prompt): q-block rows
# (block_m / 4 tokens at Llama-3's 4 query heads per KV head) x key tiles, split or not.
SHORT_SWEEP = [tk.LaunchConfig(m, t, w, 3, prefetch=True) for m, t, w in
               [(16, 64, 4), (32, 64, 4), (64, 64, 4), (64, 32, 4), (128, 64, 8), (128, 32, 8)]]
SHORT_SEGMENTS = [0, 16, 32, 64]  # 0: no split


@dataclasses.dataclass
class KVPool:
    """One shuffled paged cache big enough for every case; request b owns row b of `table`."""

    k_rot: torch.Tensor  # rotated by position, stock vLLM's cache
    v: torch.Tensor
    table: torch.Tensor  # [max_seqs, max_blocks_per_seq] int32
    cos_sin: torch.Tensor

    @classmethod
    def build(cls, max_seqs: int, max_len: int) -> "KVPool":
        per_seq = max_len // BLOCK
        blocks = max_seqs * per_seq
        perm = torch.randperm(blocks, device="cuda")
        table = perm.view(max_seqs, per_seq).to(torch.int32)
        shape = (blocks, BLOCK, KV_HEADS, HEAD)
        k, v = torch.randn(shape, dtype=DTYPE, device="cuda"), torch.randn(shape, dtype=DTYPE,
                                                                            device="cuda")
        # Llama-3's base; the values do not change the timing, only the positions do.
        cos_sin = rope_table(HEAD, max_len + 64, base=500000.0, device="cuda")
        block_pos = torch.empty(blocks, dtype=torch.long, device="cuda")
        block_pos[perm] = (torch.arange(blocks, device="cuda") % per_seq) * BLOCK
        k_rot = torch.empty_like(k)
        slots = torch.arange(BLOCK, device="cuda")
        for lo in range(0, blocks, 16384):
            chunk = slice(lo, min(lo + 16384, blocks))
            pos = (block_pos[chunk, None] + slots).flatten()
            k_rot[chunk] = rotate(k[chunk].flatten(0, 1), pos, cos_sin, HEAD, True).to(
                DTYPE).view_as(k[chunk])
        return cls(k_rot, v, table, cos_sin)


@dataclasses.dataclass
class Step:
    """One attention call: `num_seqs` requests of `q_len` new tokens after `context` cached ones."""

    num_seqs: int
    q_len: int
    context: int

    def tensors(self, pool: KVPool):
        seq_len = self.context + self.q_len
        n = self.num_seqs
        q = torch.randn(n * self.q_len, Q_HEADS, HEAD, dtype=DTYPE, device="cuda")
        cu = torch.arange(0, n + 1, dtype=torch.int32, device="cuda") * self.q_len
        lens = torch.full((n,), seq_len, dtype=torch.int32, device="cuda")
        table = pool.table[:n, : -(-seq_len // BLOCK)].contiguous()
        return q, cu, lens, table


def launchers(step: Step, pool: KVPool, out: torch.Tensor, with_m16: bool) -> dict:
    """name -> zero-argument launch of that variant on `step`, all writing `out`."""
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    q, cu, lens, table = step.tensors(pool)
    seq_len = step.context + step.q_len
    scale = HEAD ** -0.5
    split = tk.split_kv_buffers(SEQ_THRESHOLD_3D, Q_HEADS, HEAD, "cuda")
    ones = torch.ones(1, device="cuda").expand(step.num_seqs, KV_HEADS)

    def stock():
        unified_attention(
            q=q, k=pool.k_rot, v=pool.v, out=out, cu_seqlens_q=cu, max_seqlen_q=step.q_len,
            seqused_k=lens, max_seqlen_k=seq_len, softmax_scale=scale, causal=True,
            window_size=(-1, -1), block_table=table, softcap=0, q_descale=None,
            k_descale=ones, v_descale=ones, seq_threshold_3D=SEQ_THRESHOLD_3D,
            num_par_softmax_segments=tk.NUM_SPLITS, softmax_segm_output=split[0],
            softmax_segm_max=split[1], softmax_segm_expsum=split[2])

    # Span tables with no span and every frame offset 0: the kernel does a span batch's
    # work (every tile turned, the rules applied) and its output is stock attention's.
    span_of = torch.full(table.shape, -1, dtype=torch.int32, device="cuda")
    context_pos = (torch.arange(table.shape[1], dtype=torch.int32, device="cuda") * BLOCK
                   ).expand(table.shape).contiguous()
    zeros = torch.zeros_like(span_of)
    plain = SpanLayout(span_of, context_pos, zeros, zeros)

    def minipic(config=None, span_tables=True):
        if config is None:
            use_3d = step.q_len == 1 and step.num_seqs <= SEQ_THRESHOLD_3D
            config = tk.choose_config(step.q_len, use_3d)
        return lambda: tk.unified_attention_rope(
            q, pool.k_rot, pool.v, out, cu_seqlens_q=cu, seqused_k=lens, max_seqlen_q=step.q_len,
            block_table=table, softmax_scale=scale, cos_sin=pool.cos_sin, rotary_dim=HEAD,
            is_neox_style=True, split_output=split[0], split_max=split[1], split_expsum=split[2],
            seq_threshold_3d=SEQ_THRESHOLD_3D, config=config,
            **(tk.span_table_args(plain, BLOCK) if span_tables else {}))

    def fa3():
        flash_attn_varlen_func(
            q=q, k=pool.k_rot, v=pool.v, max_seqlen_q=step.q_len, cu_seqlens_q=cu,
            max_seqlen_k=seq_len, seqused_k=lens, softmax_scale=scale, causal=True,
            block_table=table, out=out, fa_version=3)

    variants = {
        "stock": stock,
        "minipic": minipic(),
        "minipic_noseg": minipic(span_tables=False),
        "stock_again": stock,
        "fa3": fa3,
    }
    if with_m16:
        m16 = tk.LaunchConfig(block_m=16, tile_size=32)
        variants["minipic_m16"] = minipic(config=m16)
        variants["m16_noseg"] = minipic(config=m16, span_tables=False)
    return variants


def measure(step: Step, pool: KVPool, with_m16: bool, extra: dict | None = None) -> dict:
    out = torch.empty(step.num_seqs * step.q_len, Q_HEADS, HEAD, dtype=DTYPE, device="cuda")
    variants = launchers(step, pool, out, with_m16)
    variants.update(extra(step, pool, out) if extra else {})
    row: dict = {"num_seqs": step.num_seqs, "q_len": step.q_len, "context": step.context,
                 "ms": {}, "graphed": {}, "err_vs_stock": {}, "errors": {}}
    variants["stock"]()
    reference = out.clone()
    rep = 300 if step.q_len > 1 else 100
    for name, fn in variants.items():
        try:
            out.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            row["err_vs_stock"][name] = relative_error(out, reference)
            row["ms"][name], row["graphed"][name] = gpu_ms(fn, rep)
        except Exception as exc:  # noqa: BLE001 - keep measuring the other variants
            row["errors"][name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
    return row


def sweep_launchers(step: Step, pool: KVPool, out: torch.Tensor) -> dict:
    """Tile-shape variants of minipic: prefill shapes, or decode shapes both split (3D) and not."""
    q, cu, lens, table = step.tensors(pool)
    decode = step.q_len == 1
    big_split = tk.split_kv_buffers(step.num_seqs, Q_HEADS, HEAD, "cuda")
    variants = {}
    for c in DECODE_SWEEP if decode else SWEEP:
        for split in ((False, True) if decode else (False,)):
            name = (f"m{c.block_m}_t{c.tile_size}_w{c.num_warps}_s{c.num_stages}"
                    f"_p{int(c.prefetch)}" + ("_3d" if split else ""))
            buffers = dict(zip(("split_output", "split_max", "split_expsum"), big_split),
                        seq_threshold_3d=step.num_seqs) if split else {}
            variants[name] = (lambda c=c, buffers=buffers: tk.unified_attention_rope(
                q, pool.k_rot, pool.v, out, cu_seqlens_q=cu, seqused_k=lens,
                max_seqlen_q=step.q_len, block_table=table, softmax_scale=HEAD ** -0.5,
                cos_sin=pool.cos_sin, rotary_dim=HEAD, is_neox_style=True, config=c, **buffers))
    return variants


def short_sweep_launchers(step: Step, pool: KVPool, out: torch.Tensor) -> dict:
    """minipic with span tables (frame offsets 0) at each short-query tile shape and KV split."""
    q, cu, lens, table = step.tensors(pool)
    span_of = torch.full(table.shape, -1, dtype=torch.int32, device="cuda")
    context_pos = (torch.arange(table.shape[1], dtype=torch.int32, device="cuda") * BLOCK
                   ).expand(table.shape).contiguous()
    zeros = torch.zeros_like(span_of)
    tables = tk.span_table_args(SpanLayout(span_of, context_pos, zeros, zeros), BLOCK)
    variants = {}
    for segments in SHORT_SEGMENTS:
        split = {}
        if segments:
            f32 = dict(dtype=torch.float32, device="cuda")
            n = step.num_seqs * step.q_len
            split = dict(split_output=torch.empty(n, Q_HEADS, segments, HEAD, **f32),
                         split_max=torch.empty(n, Q_HEADS, segments, **f32),
                         split_expsum=torch.empty(n, Q_HEADS, segments, **f32),
                         seq_threshold_3d=SEQ_THRESHOLD_3D)
        for c in SHORT_SWEEP:
            name = f"m{c.block_m}_t{c.tile_size}_w{c.num_warps}_seg{segments}"
            variants[name] = (lambda c=c, split=split: tk.unified_attention_rope(
                q, pool.k_rot, pool.v, out, cu_seqlens_q=cu, seqused_k=lens,
                max_seqlen_q=step.q_len, block_table=table, softmax_scale=HEAD ** -0.5,
                cos_sin=pool.cos_sin, rotary_dim=HEAD, is_neox_style=True, config=c,
                **split, **tables))
    return variants


def ratio_table(rows: list[dict], key: str, label: str) -> list[str]:
    """Markdown: times of stock/FA3 and each variant's time over stock's."""
    names = ["minipic", "minipic_noseg", "minipic_m16", "m16_noseg", "stock_again", "fa3"]
    names = [n for n in names if any(n in r["ms"] for r in rows)]
    head = ([label, "stock ms", "fa3 ms", "minipic ms"] + [f"{n}/stock" for n in names]
            + ["minipic/fa3"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ms = r["ms"]
        ratio = lambda a, b: f"{ms[a] / ms[b]:.3f}" if a in ms and b in ms else "n/a"  # noqa: E731
        fmt = lambda n: f"{ms[n]:.4g}" if n in ms else "n/a"  # noqa: E731
        cells = ([key.format(**r), fmt("stock"), fmt("fa3"), fmt("minipic")]
                 + [ratio(n, "stock") for n in names] + [ratio("minipic", "fa3")])
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def environment() -> dict:
    import vllm

    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "vllm": vllm.__version__,
            "command": " ".join(sys.argv)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prefill", type=int, nargs="*", default=PREFILL)
    parser.add_argument("--decode-batches", type=int, nargs="*", default=DECODE_BATCHES)
    parser.add_argument("--decode-contexts", type=int, nargs="*", default=DECODE_CONTEXTS)
    parser.add_argument("--sweep", type=int, nargs="*", default=[],
                        help="prefill lengths at which to also time the tile-shape sweep")
    parser.add_argument("--decode-sweep", nargs="*", default=[],
                        help="BATCHxCONTEXT decode shapes at which to time the decode sweep")
    parser.add_argument("--short-sweep", nargs="*", default=[],
                        help="QUERYxCONTEXT shapes (one request, e.g. 33x10000: a span hit's "
                             "final prompt) at which to time the short-query sweep")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    short = [tuple(map(int, shape.split("x"))) for shape in args.short_sweep]
    max_len = max(args.prefill + args.decode_contexts + [q + c for q, c in short]) + BLOCK
    max_seqs = max(args.decode_batches + [1])
    t0 = time.time()
    pool = KVPool.build(max_seqs, -(-max_len // BLOCK) * BLOCK)
    results = {"env": environment(), "prefill": [], "decode": [], "sweep": []}
    print(f"pool built in {time.time() - t0:.1f}s", flush=True)

    def save():
        (args.out / "results.json").write_text(json.dumps(results, indent=1))

    for n in args.prefill:
        results["prefill"].append(measure(Step(1, n, 0), pool, with_m16=True))
        print(json.dumps(results["prefill"][-1]["ms"]), flush=True)
        save()
    for n in args.sweep:
        results["sweep"].append(measure(Step(1, n, 0), pool, False, extra=sweep_launchers))
        save()
    for shape in args.decode_sweep:
        b, ctx = map(int, shape.split("x"))
        results["sweep"].append(measure(Step(b, 1, ctx - 1), pool, False, extra=sweep_launchers))
        save()
    for q_len, ctx in short:
        results["sweep"].append(measure(Step(1, q_len, ctx), pool, False,
                                        extra=short_sweep_launchers))
        print(q_len, ctx, json.dumps(results["sweep"][-1]["ms"]), flush=True)
        save()
    for b in args.decode_batches:
        for ctx in args.decode_contexts:
            results["decode"].append(measure(Step(b, 1, ctx - 1), pool, with_m16=False))
            print(b, ctx, json.dumps(results["decode"][-1]["ms"]), flush=True)
            save()

    md = [f"Environment: {json.dumps(results['env'])}", "", "Prefill (one request, no prefix):",
          ""] + ratio_table(results["prefill"], "{q_len}", "tokens")
    md += ["", "Decode (one new token per request):", ""]
    md += ratio_table(results["decode"], "{num_seqs} x {context}", "batch x context")
    for r in results["sweep"]:
        shape = (f"{r['q_len']} tokens after {r['context']}" if r["q_len"] > 1
                 else f"decode {r['num_seqs']} x {r['context'] + 1}")
        md += ["", f"Tile sweep, {shape} (ms; stock {r['ms']['stock']:.4g}):",
               ""] + [f"- {k}: {v:.4g} ({v / r['ms']['stock']:.3f} of stock)"
                      for k, v in sorted(r["ms"].items(), key=lambda kv: kv[1])]
    bad = {f"{r['num_seqs']}x{r['q_len']}+{r['context']}": r["errors"]
           for r in results["prefill"] + results["decode"] + results["sweep"] if r["errors"]}
    worst = max((e for r in results["prefill"] + results["decode"]
                 for n, e in r["err_vs_stock"].items() if n != "stock"), default=math.nan)
    md += ["", f"Largest output difference vs stock (relative norm): {worst:.2e}",
           f"Failed variants: {json.dumps(bad) if bad else 'none'}",
           f"Eager-timed (graph capture failed): "
           f"{sorted({n for r in results['prefill'] + results['decode'] for n, g in r['graphed'].items() if not g}) or 'none'}"]
    (args.out / "results.md").write_text("\n".join(md) + "\n")
    save()
    print("\n".join(md), flush=True)
    try:
        plot(results, args.out / "ratio.png")
    except Exception:  # noqa: BLE001 - the tables above are the result; the plot is a view
        traceback.print_exc()


if __name__ == "__main__":
    main()
