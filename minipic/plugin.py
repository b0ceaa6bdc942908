"""vLLM plugin entry point (`vllm.general_plugins` -> `minipic.plugin:register`).

vLLM calls `register()` in every process it starts (front end, engine core,
workers). It only installs pass-through patches; minipic acts solely for
instances whose config switches it on (see `minipic.config`).
"""

from __future__ import annotations

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from minipic import _vllm_patches
    from minipic.devtools import gc_pauses, stack_sampler, step_phases

    stack_sampler.start_from_env()  # only with MINIPIC_STACK_SAMPLES set (a benchmark's profile)
    gc_pauses.start_from_env()  # only with MINIPIC_GC_PAUSES set

    _vllm_patches.apply_all()
    step_phases.start_from_env()  # only with MINIPIC_STEP_PHASES set; times minipic's patches too
    _registered = True
