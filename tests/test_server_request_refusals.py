"""Requests and configs minipic refuses, as a user of the real OpenAI server sees them.

One server (CPU, tiny model, minipic on, block size 32, markers SSep=3, PDep=4, pad=5;
conftest's minipic_server, shared with tests/client/test_server_client.py) answers with the
official `openai` client; a second start shows a bad connector option stopping the server
before it loads the model.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import openai
import pytest
from conftest import BLOCK_SIZE

from minipic.config import connector_config

pytestmark = pytest.mark.engine
SSEP, PDEP, PAD = 3, 4, 5


@pytest.fixture(scope="module")
def client(minipic_server):
    return openai.OpenAI(base_url=f"{minipic_server}/v1", api_key="EMPTY", max_retries=0)


def words(n: int) -> list[int]:
    return [7 + i % 300 for i in range(n)]


def complete(client, prompt: list[int], max_tokens: int, **extra_body):
    model = client.models.list().data[0].id
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, extra_body=extra_body or None)


def test_misplaced_marker_is_a_400_naming_its_position(client):
    with pytest.raises(openai.BadRequestError) as error:
        complete(client, words(5) + [SSEP] + words(10), max_tokens=2)
    assert error.value.status_code == 400
    assert "prompt token 5 is minipic's SSep marker" in error.value.message


def test_link_without_its_span_is_a_400_naming_its_position(client):
    link = [6, *words(BLOCK_SIZE - 1)]  # minipic's link marker (tiny model: reserved token 6)
    with pytest.raises(openai.BadRequestError) as error:
        complete(client, words(BLOCK_SIZE) + link + [PDEP, 9], max_tokens=2)
    assert error.value.status_code == 400
    assert "prompt token 32 starts link block 1, but only 0 SSep span(s)" in error.value.message


def span(n: int) -> list[int]:
    """[SSep] + n words + padding to the block size."""
    tokens = [SSEP, *words(n)]
    return tokens + [PAD] * (-len(tokens) % BLOCK_SIZE)


HEADER = words(BLOCK_SIZE)  # one plain block, as a system prompt


def test_generating_from_inside_a_span_is_a_400(client):
    """`[header][SSep doc]` would answer from the doc alone, without the header."""
    for prompt in (HEADER + span(40), HEADER + span(40) + words(3)):
        with pytest.raises(openai.BadRequestError) as error:
            complete(client, prompt, max_tokens=4)
        assert error.value.status_code == 400
        assert "ends inside the SSep span that starts at token 32" in error.value.message


def test_span_prefills_and_opt_in_and_tasks_still_generate(client):
    prefill = span(40) + [PAD]  # what minipic's span prefills send, with max_tokens=1
    assert complete(client, prefill, max_tokens=1).usage.completion_tokens == 1
    opted_in = complete(client, HEADER + span(40), max_tokens=3,
                        vllm_xargs={"minipic_end_in_span": 1})
    assert opted_in.usage.completion_tokens == 3
    task = HEADER + span(40) + [PDEP, *words(3)]  # the question after a PDep task
    assert complete(client, task, max_tokens=3).usage.completion_tokens == 3
    assert complete(client, words(70), max_tokens=3).usage.completion_tokens == 3  # no markers


def test_bad_connector_option_stops_the_server_before_the_model_loads(tiny_model, tmp_path):
    config = connector_config({"cpu_bytes": "abc"})
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model,
         "--block-size", str(BLOCK_SIZE), "--dtype", "float32", "--enforce-eager",
         "--kv-transfer-config", json.dumps(config)],
        capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert output.count("Traceback") == 1  # the engine core and its workers never started
    assert ("ConnectorConfigError: cpu_bytes must be a positive size in bytes, or with a unit "
            "like '8GiB' or '512MiB', got 'abc'") in output
    assert "Loading weights" not in output and "EngineCore" not in output
    assert time.monotonic() - started < 120
