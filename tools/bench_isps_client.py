"""How soon the ISPS client's requests leave, with an engine that takes no time (no GPU).

The Table 1 workload at a repeat rate (`tools/bench_rag.py`'s: 2000 samples of ten documents
at 0.9 by default) goes through `InterleavedScheduler` as bench_rag sends it (one list), to a
backend that answers each request after `--answer-ms`. What is timed is the client's own work
on the event loop: when the first, the 100th and the `--slots`-th request left, and when the
last answer came back. In a Table 1 pass the engine has nothing to compute until the first
request leaves.

    .venv/bin/python tools/bench_isps_client.py --samples 2000 --repeat-rate 0.9
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from minipic.client import InterleavedScheduler, RagRequest  # noqa: E402
from minipic.client.backends.base import Completion  # noqa: E402
from minipic.devtools import llama3_8b  # noqa: E402
from minipic.devtools.bench_setup import BLOCK_SIZES  # noqa: E402
from minipic.devtools.rag_workload import rag_workload  # noqa: E402
from minipic.protocol import SpanProtocol  # noqa: E402


class InstantBackend:
    """Answers every prompt after a fixed delay, and notes when each request left."""

    def __init__(self, answer_s: float) -> None:
        self.answer_s = answer_s
        self.sent: list[float] = []

    async def complete(self, prompt, *, max_tokens: int, temperature: float = 0.0) -> Completion:
        self.sent.append(time.perf_counter())
        started = time.monotonic()
        await asyncio.sleep(self.answer_s)
        return Completion(text="", prompt_tokens=len(prompt), cached_tokens=0,
                          started_at=started, finished_at=time.monotonic())


async def timed_run(requests: list, protocol: SpanProtocol, slots: int,
                    answer_s: float) -> dict:
    backend = InstantBackend(answer_s)
    start = time.perf_counter()
    await InterleavedScheduler(backend, protocol, max_in_flight=slots).run(requests)
    done = time.perf_counter()

    def sent_ms(n: int) -> float | None:
        return round((backend.sent[n - 1] - start) * 1e3, 1) if len(backend.sent) >= n else None

    return {"requests_sent": len(backend.sent), "first_sent_ms": sent_ms(1),
            "sent_100_ms": sent_ms(100), f"sent_{slots}_ms": sent_ms(slots),
            "all_answered_ms": round((done - start) * 1e3, 1)}


def main() -> None:
    args = parse_args()
    markers = llama3_8b.MARKERS
    load = rag_workload("llama3-8b", args.samples, args.repeat_rate, args.seed,
                        BLOCK_SIZES["llama3-8b"], markers, args.repeat_window)
    requests = [RagRequest(p, max_tokens=1) for p in load.span_prompts]
    result = asyncio.run(timed_run(requests, SpanProtocol.from_dict(markers), args.slots,
                                   args.answer_ms / 1e3))
    print(json.dumps({"samples": args.samples, "repeat_rate": args.repeat_rate,
                      "slots": args.slots, **result}))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--repeat-rate", type=float, default=0.9)
    parser.add_argument("--repeat-window", type=int, default=4000)
    parser.add_argument("--slots", type=int, default=1024, help="ISPS's max_in_flight")
    parser.add_argument("--answer-ms", type=float, default=50.0,
                        help="how long the stand-in engine takes to answer a request")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


if __name__ == "__main__":
    main()
