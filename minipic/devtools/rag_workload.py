"""The Table 1 RAG workload (tools/bench_rag.py, docs/benchmarks.md): seeded samples of a
system prompt, 10 documents and a task, where a chosen fraction of the document slots repeats a
document seen earlier in the run. No engine, and seeded: the same arguments give the same
token ids in every process, so each engine child rebuilds the parent's workload."""

from __future__ import annotations

import dataclasses
import random

from minipic.devtools.bench_setup import random_words

# The workload's shape: a document body of 95 tokens + its SSep marker is 96 tokens,
# whole blocks at block size 16 (GPU) and 32 (CPU), so no padding changes the token counts.
SYSTEM_TOKENS, DOC_TOKENS, DOCS_PER_SAMPLE, TASK_TOKENS = 64, 95, 10, 31


@dataclasses.dataclass
class RagWorkload:
    span_prompts: list  # SpanPrompt per sample (the recipe's layout)
    repeat_rate: float  # the measured fraction of document slots that repeat an earlier one
    unique_docs: int
    markers: dict

    def plain_prompts(self) -> list[list[int]]:
        """The final prompts without EPIC links, every marker replaced by an ordinary token:
        the plain RAG prompt's length and compute, nothing for minipic to act on (what stock
        vLLM and config 3 get, whatever the recipe)."""
        marker_ids = set(self.markers.values())
        ordinary = 11  # a plain word id in both models' vocabularies
        return [[ordinary if t in marker_ids else t for t in without_links(p.final, self.markers)]
                for p in self.span_prompts]

    def unique_spans(self) -> list[list[int]]:
        return list({tuple(s): s for p in self.span_prompts for s in p.span_prefills}.values())


def without_links(final: list[int], markers: dict) -> list[int]:
    """An EPIC final prompt less its link segments (they sit between the spans and PDep)."""
    link = markers.get("link_token_id")
    if link is None or link not in final:
        return final
    return final[:final.index(link)] + final[final.index(markers["pdep_token_id"]):]


def repeat_slots(num_slots: int, repeat_rate: float, rng: random.Random) -> list[bool]:
    """Which document slots repeat an earlier document: exactly round(rate * slots), shuffled."""
    repeats = round(num_slots * repeat_rate)
    slots = [True] * repeats + [False] * (num_slots - repeats)
    rng.shuffle(slots)
    return slots


def draw_documents(samples: int, repeat_rate: float, rng: random.Random,
                   new_doc, window: int | None = None) -> tuple[list, list[list[int]]]:
    """(document pool, document indices per sample). A repeat slot takes a document seen
    earlier in the run (uniformly, not one already in this sample), or with `window` one of
    the `window` newest documents; a repeat slot with no such document (the run's first
    slot) takes a new one instead."""
    pool: list = []
    slots = iter(repeat_slots(samples * DOCS_PER_SAMPLE, repeat_rate, rng))
    chosen = []
    for _ in range(samples):
        sample: list[int] = []
        for repeat in (next(slots) for _ in range(DOCS_PER_SAMPLE)):
            lo = max(0, len(pool) - window) if window else 0
            candidates = len(pool) - lo - sum(1 for d in sample if d >= lo)
            if repeat and candidates > 0:
                doc = rng.randrange(lo, len(pool))
                while doc in sample:
                    doc = rng.randrange(lo, len(pool))
            else:
                pool.append(new_doc())
                doc = len(pool) - 1
            sample.append(doc)
        chosen.append(sample)
    return pool, chosen


def rag_workload(arch: str, samples: int, repeat_rate: float, seed: int, block_size: int,
                 markers: dict, window: int | None = None,
                 recipe: str = "block_attention") -> RagWorkload:
    """Seeded and reproducible: the same arguments give the same token ids in every process."""
    from minipic.client import make_span
    from minipic.client.prompts.recipes import RECIPES_BY_NAME
    from minipic.protocol import SpanProtocol

    rng = random.Random(seed)
    words = random_words(rng, arch)
    protocol = SpanProtocol.from_dict(markers)
    system = words(SYSTEM_TOKENS)
    pool, chosen = draw_documents(
        samples, repeat_rate, rng, lambda: make_span(words(DOC_TOKENS), protocol, block_size),
        window)
    build = RECIPES_BY_NAME[recipe]
    prompts = [build([pool[d] for d in docs], words(TASK_TOKENS), system=system,
                     protocol=protocol, block_size=block_size) for docs in chosen]
    slots = samples * DOCS_PER_SAMPLE
    return RagWorkload(prompts, (slots - len(pool)) / slots, len(pool), markers)
