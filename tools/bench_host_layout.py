"""Host time of a span batch's layout under Model Runner V2, on any CPU (no GPU, no engine).

A step of ISPS at a high repeat rate adds hundreds of new prompts to a running batch of
about a thousand: the runner keeps each new prompt on the host (HostPrompts.add, inside
GPUModelRunner.add_requests) and the attention builder derives the batch's SpanLayout,
span ids included (span_layout.current_layout). Both run on the step's host time, ahead of
the GPU. This tool times them as one step: block_attention prompts of `--docs` documents
drawn from a pool, `--new` of the `--rows` rows replaced each step, `--prefill-share` of
them by a document's span prefilled alone (ISPS at repeat rate 0.9 sends about as many of
those as final prompts).

`--new-rows-prefill` lays the step out as an engine does: the new rows prefill (no span
ids: only decoding rows share documents), the others decode (a row is hashed at its first
step as a decoding row; a row replaced before it never is). `--busy-thread` runs a
Python-bound thread beside the step, as the engine core's input thread is while it hashes
arriving requests, and `--switch-interval-ms` sets the GIL's switch interval
(minipic/switch_interval.py; Python's own is 5 ms).

    .venv/bin/python tools/bench_host_layout.py --rows 1024 --new 180 --steps 30
    .venv/bin/python tools/bench_host_layout.py --busy-thread --switch-interval-ms 5
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from minipic.attention import span_layout  # noqa: E402
from minipic.attention.host_prompts import HostPrompts  # noqa: E402
from minipic.client.prompts.recipes import block_attention  # noqa: E402
from minipic.protocol import SpanProtocol  # noqa: E402

PROTOCOL = SpanProtocol(ssep_token_id=1, pdep_token_id=2, pad_token_id=3)


class _Runner:
    """What current_layout reads of a Model Runner V2: its host prompts."""


def words(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(10, 30000) for _ in range(count)]


def main() -> None:
    args = parse_args()
    rng = random.Random(args.seed)
    pool = [words(rng, args.doc_tokens) for _ in range(args.pool)]

    def prompt() -> list[int]:
        built = block_attention(rng.sample(pool, args.docs), words(rng, args.task_tokens),
                                protocol=PROTOCOL, block_size=args.block_size,
                                system=words(rng, 15))
        if rng.random() < args.prefill_share:
            return rng.choice(built.span_prefills)
        return built.final

    runner, prompts = _Runner(), HostPrompts(PROTOCOL)
    runner.minipic_host_prompts = prompts
    span_layout.register_runner(runner, PROTOCOL)
    rows = np.arange(args.rows)
    span_layout.note_mrv2_batch(torch.from_numpy(rows), rows)
    torch.set_num_threads(1)  # as the builder runs (SpanBatchBuilder.build)
    for row in rows.tolist():
        prompts.add(row, prompt())
    longest = max(prompts.blocks(rows, args.block_size, 1, span_ids=False)[2]) + args.block_size
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    if args.busy_thread:
        threading.Thread(target=_hold_the_gil, daemon=True).start()
    adds, layouts = [], []
    for step in range(args.steps + 1):
        new = {row: prompt() for row in rng.sample(range(args.rows), args.new)}
        start = time.perf_counter()
        for row, tokens in new.items():
            prompts.add(row, tokens)
        added = time.perf_counter()
        # the new rows prefill this step (their queries longer than a token), the others
        # decode: only decoding rows get span ids (span_layout.current_layout)
        decoding = None
        if args.new_rows_prefill:
            decoding = np.ones(args.rows, dtype=bool)
            decoding[list(new)] = False
        span_layout.current_layout(args.rows, args.block_size, longest, decoding)
        if step:  # step 0 fills every row once
            adds.append(added - start)
            layouts.append(time.perf_counter() - added)
    result = {"rows": args.rows, "new_per_step": args.new, "steps": args.steps,
              "docs": args.docs, "prefill_share": args.prefill_share,
              "new_rows_prefill": args.new_rows_prefill,
              "busy_thread": args.busy_thread,
              "switch_interval_ms": round(sys.getswitchinterval() * 1e3, 3),
              "median_add_ms": round(statistics.median(adds) * 1e3, 3),
              "median_layout_ms": round(statistics.median(layouts) * 1e3, 3)}
    print(json.dumps(result))


def _hold_the_gil() -> None:
    """Pure Python for ever: it gives the GIL up only when the switch interval asks it to."""
    x = 0
    while True:
        for i in range(1000):
            x = hash((i, x))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1024, help="running requests")
    parser.add_argument("--new", type=int, default=180, help="new requests a step")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--docs", type=int, default=10, help="documents a prompt")
    parser.add_argument("--doc-tokens", type=int, default=100)
    parser.add_argument("--task-tokens", type=int, default=32)
    parser.add_argument("--prefill-share", type=float, default=0.5,
                        help="share of new prompts that are a span prefilled alone")
    parser.add_argument("--pool", type=int, default=400, help="distinct documents")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--new-rows-prefill", action="store_true",
                        help="the new rows prefill this step and the others decode, as in an "
                             "engine step (default: every row is laid out as decoding, span "
                             "ids for all)")
    parser.add_argument("--busy-thread", action="store_true",
                        help="a Python-bound thread beside the step (an input thread hashing)")
    parser.add_argument("--switch-interval-ms", type=float,
                        help="the GIL's switch interval (default: Python's, 5 ms)")
    return parser.parse_args()


if __name__ == "__main__":
    main()
