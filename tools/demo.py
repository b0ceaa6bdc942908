"""minipic demo: preload a small corpus, ask RAG questions, compare minipic on and off.

    python tools/demo.py        # CPU, a few minutes; builds a tiny random model, no model hub

For each engine in turn (minipic on, then a stock engine with minipic off):
  1. start an in-process vLLM AsyncLLM on a tiny random Llama;
  2. preload examples/corpus/ (minipic-preload's Python API): every document
     becomes spans, prefilled once into the engine's cache;
  3. ask three questions, each over several documents, with the RAG client:
     prompt = [system][doc][doc]...[links][question] in the EPIC layout (the RAG
     client's default recipe).
Then, per question: how many prompt tokens came from cache, and the time of
the final prompt (prefill plus one generated token), minipic on vs off.

With minipic on, every document hits wherever it sits in the prompt; with it
off, vLLM's prefix cache only reuses the system prompt (the documents follow
it in a different order than they were preloaded). The model is random, so
the answers are noise: this demo is about what gets recomputed.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # keep the demo's output readable
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "examples" / "corpus"
SYSTEM = "You are a helpful assistant. Answer the question from the documents."
QUESTIONS = [
    ("Which river runs through Paris, and what is the city's best known tower?",
     ["rivers.jsonl#thames", "cities/paris.md", "rivers.jsonl#rhine", "cities/rome.txt"]),
    ("Who wrote the novel in which a knight attacks windmills?",
     ["books.parquet#faust", "books.parquet#don-quixote", "books.parquet#tale-of-two-cities"]),
    ("Which of these rivers is the longest, and where does it end?",
     ["rivers.jsonl#rhine", "rivers.jsonl#nile", "cities/rome.txt", "rivers.jsonl#thames"]),
]
ENGINE_ARGS = dict(enforce_eager=True, block_size=32, dtype="float32", max_model_len=2048,
                   gpu_memory_utilization=0.1, max_num_seqs=16, seed=0,
                   enable_prefix_caching=True, disable_log_stats=True)


async def run_engine(model: str, minipic_on: bool, manifest: Path) -> list:
    from minipic.client import DocRef, RagClient
    from minipic.client.backends import AsyncLLMBackend
    from minipic.client.preload.manifest import Manifest
    from minipic.client.preload.cli import format_summary
    from minipic.client.preload.pipeline import preload

    extra = {"additional_config": {"minipic": {}}} if minipic_on else {}
    backend = AsyncLLMBackend.start(model=model, **ENGINE_ARGS, **extra)
    try:
        report = await preload(CORPUS, backend, manifest_path=manifest, id_field="id",
                               progress=False)
        print(format_summary(report).replace(str(manifest), "(temporary)"), end="\n\n")
        client = RagClient(backend, system=SYSTEM, manifest=Manifest.read(manifest),
                           max_tokens=1)
        return [await client.ask(question, [DocRef(d) for d in docs])
                for question, docs in QUESTIONS]
    finally:
        await backend.close()


def print_comparison(on: list, off: list) -> None:
    print(f"{'question':<44} {'cached prompt tokens':>24} {'final prompt (ms)':>20}")
    print(f"{'':<44} {'minipic on':>12}{'off':>12} {'on':>10}{'off':>10}")
    for (question, _), a, b in zip(QUESTIONS, on, off):
        total = len(a.request.prompt.final)
        label = question if len(question) <= 43 else question[:40] + "..."
        print(f"{label:<44} {f'{a.cached_tokens}/{total}':>12}{f'{b.cached_tokens}/{total}':>12}"
              f" {a.completion.seconds * 1e3:>10.1f}{b.completion.seconds * 1e3:>10.1f}")
    print("\ncached = tokens vLLM reports as served from cache (num_cached_tokens); the rest "
          "was computed.")


def main() -> int:
    from minipic.devtools.tiny_llama import build_tiny_llama

    with tempfile.TemporaryDirectory(prefix="minipic-demo-") as tmp:
        model = str(build_tiny_llama(Path(tmp) / "tiny-llama"))
        results = {}
        for minipic_on in (True, False):
            print(f"== engine with minipic {'on' if minipic_on else 'off'}: preload "
                  f"{CORPUS.relative_to(REPO)}/", flush=True)
            results[minipic_on] = asyncio.run(
                run_engine(model, minipic_on, Path(tmp) / f"manifest-{minipic_on}.parquet"))
            gc.collect()  # let the stopped engine go now, not at interpreter exit
        print_comparison(results[True], results[False])
    return 0


if __name__ == "__main__":  # vLLM starts processes that re-import this module
    sys.exit(main())
