"""The client tools against a real OpenAI-compatible vLLM server (one start, CPU, minipic on).

The server runs `python -m vllm.entrypoints.openai.api_server` with
`--additional-config '{"minipic": {}}'` and `--enable-prompt-tokens-details`,
which makes vLLM report cached prompt tokens in the completions' usage.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
from conftest import BLOCK_SIZE, api_server

from minipic.client.backends import OpenAIServerBackend
from minipic.client.rag.isps import InterleavedScheduler
from minipic.client.preload.manifest import Manifest
from minipic.client.preload.cli import main
from minipic.client.rag.client import DocRef, RagClient
from minipic.client.rag.request import RagRequest
from minipic.client.prompts.recipes import block_attention

pytestmark = pytest.mark.engine
EXAMPLES = Path(__file__).parents[2] / "examples" / "corpus"
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def url(tiny_model, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with api_server(tiny_model, log_path, "--max-model-len", str(MAX_MODEL_LEN),
                    "--additional-config", json.dumps({"minipic": {}})) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def manifest(url, tmp_path_factory):
    return tmp_path_factory.mktemp("preload") / "manifest.parquet"


def preload_cli(url, manifest, *more):
    """No --block-size: the block size and markers come from the server."""
    return main([str(EXAMPLES), "--url", url, "--manifest", str(manifest), "--id-field", "id",
                 "--no-progress", *more])


def test_preload_over_the_server_then_again(url, manifest, capfd):
    assert preload_cli(url, manifest) == 0
    out, _ = capfd.readouterr()
    spans = len({r.span_key for r in Manifest.read(manifest).records})
    assert "documents  8 read" in out and f"{spans} new, 0 already stored, 0 failed" in out

    assert preload_cli(url, manifest) == 0
    out, _ = capfd.readouterr()
    assert f"0 new, {spans} already stored, 0 failed" in out


def test_rag_client_over_the_server(url, manifest):
    async def ask():
        backend = await OpenAIServerBackend.connect(url)  # the server's block size
        try:
            client = RagClient(backend, system="you are a helpful assistant .",
                               manifest=Manifest.read(manifest), max_tokens=4)
            docs = [DocRef("rivers.jsonl#nile"), DocRef("cities/paris.md")]
            return await client.ask("which river is the longest ?", docs)
        finally:
            await backend.close()

    answer = asyncio.run(ask())
    assert answer.cached_tokens == answer.expected_cached_tokens > 0
    # The preloaded documents were found stored; only the header was new.
    assert [s.already_stored for s in answer.spans] == [False, True, True]


def words(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(7, 400) for _ in range(n)]


def test_isps_over_the_server(url):
    async def run():
        backend = await OpenAIServerBackend.connect(url, block_size=BLOCK_SIZE)
        assert backend.max_model_len == MAX_MODEL_LEN  # read from the server's model card
        protocol = backend.span_protocol()
        docs = [words(30 + 20 * i, 900 + i) for i in range(4)]
        layouts = [(0, 1), (1, 2, 3), (3, 0), (2,)]
        requests = [RagRequest(block_attention([docs[i] for i in ids], words(6, 950 + n),
                                               system=words(20, 999), protocol=protocol,
                                               block_size=BLOCK_SIZE), max_tokens=2)
                    for n, ids in enumerate(layouts)]
        too_long = RagRequest(block_attention([words(MAX_MODEL_LEN + 10, 960)], [9],
                                              protocol=protocol, block_size=BLOCK_SIZE))
        try:
            scheduler = InterleavedScheduler(backend, protocol, max_in_flight=2)
            return await asyncio.wait_for(scheduler.run(requests[:2] + [too_long] +
                                                        requests[2:]), 240)
        finally:
            await backend.close()

    results = asyncio.run(run())
    assert [r.ok for r in results] == [True, True, False, True, True]
    for r in results[:2] + results[3:]:
        assert r.cached_tokens == r.expected_cached_tokens > 0


def test_a_block_size_that_disagrees_with_the_server_is_refused(url, tmp_path, capfd):
    assert preload_cli(url, tmp_path / "m.parquet", "--block-size", "16") == 2
    assert "the server runs with KV blocks of 32 tokens" in capfd.readouterr().err
    assert not (tmp_path / "m.parquet").exists()

    async def connect():
        from minipic.client.backends.server_settings import SettingsDisagreeError

        with pytest.raises(SettingsDisagreeError, match="blocks of 32 tokens"):
            await OpenAIServerBackend.connect(url, block_size=16)
        backend = await OpenAIServerBackend.connect(url, block_size=BLOCK_SIZE)  # agrees
        assert backend.block_size == BLOCK_SIZE
        assert backend.span_protocol().to_dict() == {
            "ssep_token_id": 3, "pdep_token_id": 4, "pad_token_id": 5, "link_token_id": 6}
        await backend.close()

    asyncio.run(connect())
