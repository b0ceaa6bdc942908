"""The client tools against a real OpenAI-compatible vLLM server (CPU, minipic on; one start,
conftest's minipic_server, shared with tests/test_server_request_refusals.py).

The server runs `python -m vllm.entrypoints.openai.api_server` with
`--additional-config '{"minipic": {}}'` and `--enable-prompt-tokens-details`,
which makes vLLM report cached prompt tokens in the completions' usage, and a
chat template (the tiny tokenizer has none) for chat requests with `documents`.
`minipic-preload --url` sends documents as text to POST /v1/minipic/preload.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import httpx
import openai
import pytest
from conftest import BLOCK_SIZE

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
def url(minipic_server):
    return minipic_server  # max_model_len MAX_MODEL_LEN, a chat template (conftest.py)


@pytest.fixture
def no_local_tokenizer(monkeypatch):
    """Preloading over HTTP must not load a tokenizer in the client."""
    from transformers import AutoTokenizer

    def refuse(*args, **kwargs):
        raise AssertionError("the client loaded a tokenizer")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", refuse)


@pytest.fixture(scope="module")
def manifest(url, tmp_path_factory):
    return tmp_path_factory.mktemp("preload") / "manifest.parquet"


def preload_cli(url, manifest, *more):
    """No --block-size: the block size and markers come from the server."""
    return main([str(EXAMPLES), "--url", url, "--manifest", str(manifest), "--id-field", "id",
                 "--no-progress", *more])


def test_preload_over_the_server_then_again(url, manifest, capfd, no_local_tokenizer):
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


# Preloading over HTTP: documents as text, spans cut and prefilled by the server.
DOCS = {"madrid.txt": "madrid is the capital of spain . the king was born in madrid . " * 6,
        "tokyo.txt": "tokyo is the capital of japan . " * 9,
        "london.txt": "london is the capital of england . a river of london . " * 4}
PRELOAD_URL = "/v1/minipic/preload"


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("small-corpus")
    for name, text in DOCS.items():
        (folder / name).write_text(text)
    return folder


@pytest.fixture(scope="module")
def small_manifest(tmp_path_factory):
    return tmp_path_factory.mktemp("small-preload") / "manifest.parquet"


def test_preloaded_documents_hit_in_a_chat_request(url, small_corpus, small_manifest, capfd,
                                                    no_local_tokenizer):
    argv = [str(small_corpus), "--url", url, "--manifest", str(small_manifest), "--no-progress"]
    assert main(argv) == 0
    assert "documents  3 read" in capfd.readouterr().out
    records = Manifest.read(small_manifest).records
    assert {r.status for r in records} == {"new"}

    # Another order than the corpus's: spans hit at any offset. No system message, so the
    # prompt starts with the spans and every preloaded token is a hit.
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0)
    response = client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=2, temperature=0,
        messages=[{"role": "user", "content": "what is the capital of japan ?"}],
        extra_body={"documents": [{"text": DOCS[name]} for name in
                                  ("tokyo.txt", "london.txt", "madrid.txt")]})
    span_tokens = sum(len(r.token_ids) for r in records)
    assert span_tokens > sum(len(text.split()) for text in DOCS.values())
    assert response.usage.prompt_tokens_details.cached_tokens == span_tokens

    assert main(argv + ["--trust-manifest"]) == 0  # the server skips them: no prefill
    assert f"0 new, {len(records)} already stored ({len(records)} per manifest)" in \
        capfd.readouterr().out


def test_the_manifest_is_what_the_client_side_path_records(url, small_corpus, small_manifest,
                                                          tmp_path, capfd):
    """The token-id path (spans cut here, sent to /v1/completions) records the same spans,
    and finds every one stored by the server's preload."""
    local = tmp_path / "local.parquet"
    assert main([str(small_corpus), "--url", url, "--manifest", str(local), "--no-progress",
                 "--trust-server", "--block-size", str(BLOCK_SIZE)]) == 0
    server_side, client_side = Manifest.read(small_manifest), Manifest.read(local)
    assert f"0 new, {len(client_side.records)} already stored" in capfd.readouterr().out

    def rows(manifest):
        return sorted((r.doc_id, r.source, r.span_index, r.span_count, r.span_key,
                       list(r.token_ids)) for r in manifest.records)

    assert rows(server_side) == rows(client_side)
    assert server_side.info == client_side.info


def test_preload_route_answers_spans_and_statuses(url):
    texts = ["rome is the capital of italy . " * 5, "w1 w2 w3 w4 " * 20]
    first = httpx.post(f"{url}{PRELOAD_URL}", json={"documents": texts}, timeout=120).json()
    assert (first["block_size"], first["span_tokens"]) == (BLOCK_SIZE, 512)
    assert first["span_protocol"] == {"ssep_token_id": 3, "pdep_token_id": 4,
                                      "pad_token_id": 5, "link_token_id": 6}
    rome, words_doc = first["documents"]
    [span] = rome["spans"]
    assert span["status"] == "new" and span["cached_tokens"] == rome["cached_tokens"] == 0
    assert span["num_tokens"] == len(span["token_ids"]) == rome["num_tokens"] == 2 * BLOCK_SIZE
    assert span["token_ids"][0] == 3 and span["error"] is None

    again = httpx.post(f"{url}{PRELOAD_URL}", timeout=120, json={
        "documents": texts, "skip_span_keys": [span["span_key"]]}).json()
    skipped, stored = again["documents"][0]["spans"][0], again["documents"][1]["spans"][0]
    assert skipped["status"] == "skipped" and skipped["cached_tokens"] is None
    assert stored["status"] == "stored" and stored["cached_tokens"] == stored["num_tokens"]
    assert again["documents"][0]["cached_tokens"] is None


@pytest.mark.parametrize("body, reason", [
    ({"documents": []}, '"documents" must be a non-empty list of texts'),
    ({"documents": "paris"}, '"documents" must be a non-empty list of texts'),
    ({"documents": ["paris", 5]}, "documents[1] must be a string (the document's text), got int"),
    ({"documents": ["paris", " \n"]}, "documents[1] is empty"),
    ({"documents": ["paris"], "span_tokens": 4096},
     "spans of 4096 tokens do not fit this server's max_model_len 1024"),
    ({"documents": ["a <|reserved_special_token_0|> b"]}, "contains the SSep marker"),
    ({"documents": ["paris"], "block_size": 16}, "unknown key(s) 'block_size'"),
    ([], "the body must be a JSON object"),
])
def test_bad_preload_requests_are_a_400_with_the_reason(url, body, reason):
    response = httpx.post(f"{url}{PRELOAD_URL}", json=body, timeout=60)
    assert response.status_code == 400
    assert reason in response.json()["error"]["message"]


def test_a_body_that_is_not_json_is_a_400(url):
    response = httpx.post(f"{url}{PRELOAD_URL}", content=b"documents=paris", timeout=60)
    assert response.status_code == 400
    assert "the body is not JSON" in response.json()["error"]["message"]


def test_a_document_the_server_refuses_is_reported_and_the_rest_preloaded(url, tmp_path,
                                                                          capfd):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "good.txt").write_text("madrid is a city of spain . " * 4)
    (corpus / "marker.txt").write_text("a <|reserved_special_token_1|> inside the text")
    manifest = tmp_path / "m.parquet"
    assert main([str(corpus), "--url", url, "--manifest", str(manifest), "--no-progress"]) == 1
    out, err = capfd.readouterr()
    assert "documents  1 read, 1 skipped for problems" in out
    assert "marker.txt: refused by the server: documents[0], span 0 contains the PDep marker" \
        in err
    assert Manifest.read(manifest).doc_ids() == ["good.txt"]
