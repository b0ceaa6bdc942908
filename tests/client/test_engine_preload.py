"""`minipic-preload` in process, into a MiniPICConnector span store, with real CPU engines.

Run 1 (CLI, fresh store) stores every span and reports the corpus's bad files
with exit status 1. Run 2 (CLI, a new engine process on the same store) finds
every span already stored. Then a `vllm.LLM` on the same store serves a RAG
client whose final prompts hit the preloaded spans.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
from conftest import BLOCK_SIZE, engine_kwargs, start_llm, stop_llm

from minipic.client.backends import LLMBackend
from minipic.client.preload.manifest import NEW, STORED, Manifest
from minipic.client.preload.cli import main
from minipic.config import connector_config as minipic_connector
from minipic.client.preload.pipeline import preload
from minipic.client.rag.client import DocRef, RagClient

pytestmark = pytest.mark.engine
EXAMPLES = Path(__file__).parents[2] / "examples" / "corpus"
ENGINE_ARGS = {k: v for k, v in engine_kwargs("unused").items() if k != "model"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus") / "docs"
    shutil.copytree(EXAMPLES, corpus)
    (corpus / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (corpus / "empty.md").write_text("\n")
    with (corpus / "rivers.jsonl").open("a") as f:
        f.write('{"title": "a record without text"}\n')
    return corpus


@pytest.fixture(scope="module")
def connector_config(tmp_path_factory):
    return {"store_dir": str(tmp_path_factory.mktemp("store")), "cpu_bytes": 64 << 20}


def preload_cli(model, corpus, manifest, connector_config):
    return main([str(corpus), "--model", model, "--connector-config",
                 json.dumps(connector_config), "--engine-args", json.dumps(ENGINE_ARGS),
                 "--manifest", str(manifest), "--id-field", "id", "--span-tokens", "128",
                 "--no-progress"])


def test_first_run_stores_every_span_and_reports_bad_files(tiny_model, corpus,
                                                           connector_config, tmp_path, capfd):
    manifest = tmp_path / "manifest.parquet"
    code = preload_cli(tiny_model, corpus, manifest, connector_config)
    out, err = capfd.readouterr()
    assert code == 1  # bad inputs were skipped
    for where in ("latin1.txt: not UTF-8", "empty.md: empty document",
                  "rivers.jsonl:4: no 'text' field"):
        assert where in err
    written = Manifest.read(manifest)
    assert len(written.doc_ids()) == 8 and written.info.block_size == BLOCK_SIZE
    assert {r.status for r in written.records} == {NEW}
    spans = len({r.span_key for r in written.records})
    assert f"{spans} new, 0 already stored" in out

    # A new engine process on the same store: nothing left to prefill.
    code = preload_cli(tiny_model, corpus, manifest, connector_config)
    out, err = capfd.readouterr()
    assert code == 1 and "latin1.txt: not UTF-8" in err
    assert f"0 new, {spans} already stored" in out
    assert {r.status for r in Manifest.read(manifest).records} == {STORED}
    assert all(r.cached_tokens == len(r.token_ids) for r in Manifest.read(manifest).records)


def test_llm_on_the_store_answers_with_preloaded_spans(tiny_model, connector_config, tmp_path):
    manifest = tmp_path / "manifest.parquet"
    llm = start_llm(tiny_model, kv_transfer_config=minipic_connector(connector_config))
    try:
        backend = LLMBackend(llm)
        report = asyncio.run(preload(EXAMPLES, backend, manifest_path=manifest, id_field="id",
                                     span_tokens=128, progress=False))
        assert report.ok and report.count(STORED) == report.spans  # read back from disk

        client = RagClient(backend, system="you are a helpful assistant .",
                           manifest=Manifest.read(manifest), max_tokens=4)
        docs = [DocRef("cities/rome.txt"), DocRef("books.parquet#faust"),
                DocRef("rivers.jsonl#rhine")]
        answer = asyncio.run(client.ask("who wrote faust ?", docs))  # EPIC, the default
        final = answer.request.prompt.final
        assert answer.cached_tokens == answer.expected_cached_tokens
        # The header and every span hit; the links and the question are computed.
        assert answer.expected_cached_tokens == final.index(client.protocol.link_token_id)
        assert final.count(client.protocol.link_token_id) == len(answer.request.prompt.span_prefills) - 1
    finally:
        stop_llm(llm)
