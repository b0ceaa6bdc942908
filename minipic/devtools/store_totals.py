"""A store's totals for the benchmarks: what it holds (spans, blocks, bytes) and its usage
counters, each summed over its namespaces and over every engine process so far.
tools/bench_rag.py (config 6) and tools/bench_ttft.py (its disk phases, through
minipic.devtools.ttft_phases) read them before and after a run."""

from __future__ import annotations

import os

CONTENTS = ("spans", "blocks", "bytes")


def store_totals(store: str) -> dict[str, int]:
    """Every content and counter key, summed; all zero where the store does not exist yet."""
    # Imported here: the tools' --help runs without the store's dependencies (blake3).
    from minipic.connector.store.stats import COUNTERS, scan_store

    totals = dict.fromkeys((*CONTENTS, *COUNTERS), 0)
    for ns in scan_store(store) if os.path.isdir(store) else []:
        for k in CONTENTS:
            totals[k] += getattr(ns, k)
        for k, v in ns.counters.items():
            totals[k] = totals.get(k, 0) + v
    return totals
