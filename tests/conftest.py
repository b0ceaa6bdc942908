"""Shared fixtures: a tiny random Llama on disk and real vLLM CPU engines."""

from __future__ import annotations

import gc
import os

import pytest

# CPU engines: KV cache in GiB, and no accidental hub access.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

BLOCK_SIZE = 32  # CPU attention needs a multiple of 32


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from minipic.devtools.tiny_llama import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def engine_kwargs(model: str, **overrides) -> dict:
    """LLM(...) arguments for a small, deterministic CPU engine."""
    kwargs = dict(model=model, enforce_eager=True, block_size=BLOCK_SIZE, dtype="float32",
                  gpu_memory_utilization=0.1, max_model_len=1024, enable_prefix_caching=True,
                  max_num_seqs=16, seed=0)
    kwargs.update(overrides)
    return kwargs


def start_llm(model: str, **overrides):
    from vllm import LLM

    return LLM(**engine_kwargs(model, **overrides))


def stop_llm(llm) -> None:
    """Stop the engine-core process now rather than at interpreter exit."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


MINIPIC_ON = {"additional_config": {"minipic": {}}}
