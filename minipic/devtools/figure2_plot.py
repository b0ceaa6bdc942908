"""Figure 2 (preload times and TTFT vs cached documents) as a PNG, from bench_rag's figure2.json.

    python -m minipic.devtools.figure2_plot docs/results/figure2.json [--vllm 0.25.1] \\
        [--stock-attention FA3] [--out docs/results/figure2.png]

tools/bench_rag.py figure2 draws it after a run; this re-draws a saved run. The title says
which model, GPU, vLLM and mode the numbers are from; the series carry the names users know
("stock vLLM (FA3)", "minipic, GPU hit", "minipic, from disk"). Facts a run did not record
(files from before they were recorded) come from --vllm and --stock-attention, or show as "?".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MODELS = {"llama3-8b": "Llama-3-8B shape (dummy weights, bf16)",
          "tiny": "tiny random Llama (CPU smoke run: timings mean nothing)"}


def run_facts(data: dict, vllm: str | None = None, stock_attention: str | None = None) -> dict:
    """Model, GPU, vLLM version, mode and stock's attention of a figure2.json. Runs merged
    from two invocations keep `args` and `host` per part; the first part speaks for both."""
    args, host = data.get("args", {}), data.get("host", {})
    if "arch" not in args and args:
        args = next(iter(args.values()))
    if "python" not in host and host:
        host = next(iter(host.values()))
    gpu = (host.get("gpu") or "CPU").splitlines()[0]
    return {"model": MODELS.get(args.get("arch"), args.get("arch", "?")), "gpu": gpu,
            "vllm": host.get("vllm") or vllm or "?",
            "mode": "eager" if args.get("eager") else "compiled (CUDA graphs)",
            "stock_attention": host.get("stock_attention") or stock_attention or "?"}


def phase_label(phase: str, stock: str) -> str:
    """bench_ttft's phase names as users say them."""
    if phase == "stock":
        return f"{stock}, full prefill"
    if phase == "gpu-hit":
        return "minipic, GPU hit"
    if phase.startswith("disk-"):  # disk-warm-t16-p16: page cache warm, 16 threads, 16 processes
        kind, *parts = phase[len("disk-"):].split("-")
        cache = "page cache warm" if kind == "warm" else "page cache dropped"
        readers = {"t": "threads", "p": "processes"}
        how = ", ".join(f"{p[1:]} {readers[p[0]]}" for p in parts if p[:1] in readers)
        return f"minipic, from disk ({cache}; {how})" if how else f"minipic, from disk ({cache})"
    return phase


def plot(data: dict, path: Path, facts: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stock = f"stock vLLM ({facts['stock_attention']})"
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.6))
    for series in (s for s in data.get("preload", []) if "error" not in s):
        label = stock if series["name"] == "stock" else "minipic"
        axes[0].plot([p["tokens"] for p in series["by_length"]],
                     [p["seconds"] for p in series["by_length"]], "o-", label=label)
        axes[1].plot([p["docs"] for p in series["by_docs"]],
                     [p["seconds"] for p in series["by_docs"]], "o-", label=label)
    for phase in (p for p in data.get("ttft", []) if "error" not in p):
        points = phase["points"]
        [line] = axes[2].plot([p["docs"] for p in points],
                              [p["median_ttft_s"] * 1e3 for p in points], "o-",
                              label=phase_label(phase["phase"], stock))
        if all("median_rerun_ttft_s" in p for p in points):  # stock's colour, dashed
            axes[2].plot([p["docs"] for p in points],
                         [p["median_rerun_ttft_s"] * 1e3 for p in points], "o--",
                         color=line.get_color(), label=f"{stock}, its own full prefix hit")
    titles = [("preload time vs prompt length (no spans)", "prompt tokens", "seconds"),
              ("preload time vs document count", "documents in one batch", "seconds"),
              ("TTFT vs cached documents", "documents in the final prompt", "median TTFT (ms)")]
    axes[2].set_yscale("log")  # stock and a hit differ by orders of magnitude at 40 documents
    for ax, (title, x, y) in zip(axes, titles):
        ax.set(title=title, xlabel=x, ylabel=y)
        ax.grid(alpha=0.3)
        # below the panel: the TTFT curves fill theirs
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16))
    fig.suptitle(f"{facts['model']} · {facts['gpu']} · vLLM {facts['vllm']} · {facts['mode']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("data", type=Path, help="a figure2.json")
    parser.add_argument("--out", type=Path, help="default: figure2.png beside the data")
    parser.add_argument("--vllm", help="the vLLM version, where the run did not record it")
    parser.add_argument("--stock-attention", help="stock's attention (FA3, FA2, Triton, CPU), "
                        "where the run did not record it")
    args = parser.parse_args()
    data = json.loads(args.data.read_text())
    out = args.out or args.data.with_name("figure2.png")
    plot(data, out, run_facts(data, args.vllm, args.stock_attention))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
