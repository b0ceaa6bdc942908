"""tools/bench_kernel.py's plot: attention kernel times over stock vLLM's FlashAttention 3.

    python -m minipic.devtools.kernel_plot OUT/results.json [--out OUT/ratio.png]

bench_kernel draws it after a run; this re-draws a saved run. Every series is a time over
FA3's on the same problem (what vLLM runs on Hopper, and what minipic runs for batches
without markers), under the names users know; the title says which shapes, GPU, vLLM and
timing the numbers are from.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

BASELINE = "fa3"
# bench_kernel's variant names as users say them (the rest are not drawn)
SERIES = {
    "minipic": "minipic span kernel",
    "minipic_noseg": "minipic kernel, no span tables",
    "stock": "stock vLLM Triton",
}


def title(env: dict) -> str:
    return (f"Attention time / stock vLLM (FA3): Llama-3-8B shapes (32 query heads, 8 KV heads, "
            f"head 128, bf16, block 16)\n{env.get('gpu', '?')}, vLLM {env.get('vllm', '?')}, "
            f"each launch replayed from a CUDA graph")


def over_baseline(row: dict, name: str) -> float:
    """`name`'s time over FA3's in one bench_kernel row (NaN where either is missing)."""
    ms = row["ms"]
    if name not in ms or BASELINE not in ms:
        return math.nan
    return ms[name] / ms[BASELINE]


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_p, ax_d) = plt.subplots(1, 2, figsize=(12, 5))
    prefill = results["prefill"]
    for (name, label), style in zip(SERIES.items(), ("o-", "x--", "s:")):
        ax_p.plot([r["q_len"] for r in prefill], [over_baseline(r, name) for r in prefill],
                  style, label=label)
    ax_p.set(xlabel="prefill tokens (one request)", title="Prefill")
    for batch in sorted({r["num_seqs"] for r in results["decode"]}):
        rows = [r for r in results["decode"] if r["num_seqs"] == batch]
        for name, style in (("minipic", "o-"), ("stock", "s:")):
            ax_d.plot([r["context"] for r in rows], [over_baseline(r, name) for r in rows],
                      style, label=f"{SERIES[name]}, batch {batch}")
    ax_d.set(xlabel="context tokens per request", title="Decode")
    for ax in (ax_p, ax_d):
        ax.axhline(1.0, color="gray", lw=0.8, label="stock vLLM (FA3)")
        ax.set_xscale("log", base=2)
        ax.set_ylabel("time / stock vLLM (FA3) time")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title(results.get("env", {})), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    plot(json.loads(args.results.read_text()), args.out or args.results.with_name("ratio.png"))


if __name__ == "__main__":
    main()
