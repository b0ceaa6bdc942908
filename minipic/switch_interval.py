"""The GIL's switch interval in the engine processes minipic runs in (option
`switch_interval_ms`).

The engine core runs each step on its main thread while its input thread turns arriving
requests into block hashes, pure Python that holds the GIL. Every torch op and kernel launch
of the step gives the GIL up, and Python hands it back only after the other thread has held
it for the switch interval (5 ms by default). A minipic step makes many such calls on the
host (the span layout about 100, the attention's turn, rows and merge launches each layer),
so while requests arrive each call could wait up to 5 ms: a 1024-row span layout took 13 ms
alone and 486 ms beside a Python-bound thread, 47 ms at 0.2 ms (tools/bench_host_layout.py
--busy-thread, docs/attention.md). ISPS sends a batch's final prompts as their documents
finish, while the next steps are built.
"""

from __future__ import annotations

import sys
from typing import Any

from minipic.config import switch_interval_ms


def apply_switch_interval(vllm_config: Any) -> None:
    """In a process of minipic's engine (the engine core, where the input thread runs
    beside the scheduler, and each worker, whose step builds the span batches): its switch
    interval. Not where the engine core runs in the user's own process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0): that process is the user's, and has no input thread."""
    from vllm import envs

    interval = switch_interval_ms(vllm_config)
    if interval is not None and envs.VLLM_ENABLE_V1_MULTIPROCESSING:
        sys.setswitchinterval(interval / 1000)
