"""Preload and the RAG client against a fake engine: statuses, re-runs, problems, interrupts."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
from fake_backend import FakeBackend

from minipic.client.preload.manifest import FAILED, NEW, PENDING, STORED, Manifest
from minipic.client.preload.cli import format_problems, format_summary
from minipic.client.preload.pipeline import preload
from minipic.client.rag.client import DocRef, RagClient

EXAMPLES = Path(__file__).parents[2] / "examples" / "corpus"
EXAMPLE_IDS = sorted(["books.parquet#tale-of-two-cities", "books.parquet#don-quixote",
               "books.parquet#faust", "cities/paris.md", "cities/rome.txt",
               "rivers.jsonl#nile", "rivers.jsonl#rhine", "rivers.jsonl#thames"])


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from minipic.devtools.tiny_llama import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def run_preload(corpus, backend, manifest, **kwargs):
    return asyncio.run(preload(corpus, backend, manifest_path=manifest, id_field="id",
                               progress=False, concurrency=4, **kwargs))


def test_example_corpus_then_a_resumed_run(tokenizer, tmp_path):
    backend, manifest = FakeBackend(tokenizer=tokenizer, delay_s=0), tmp_path / "m.parquet"
    first = run_preload(EXAMPLES, backend, manifest, span_tokens=64)
    assert first.ok and first.documents == len(EXAMPLE_IDS) and not first.problems
    assert first.count(NEW) == first.spans > len(EXAMPLE_IDS)  # long documents: several spans
    written = Manifest.read(manifest)
    assert sorted(written.doc_ids()) == EXAMPLE_IDS
    assert written.info.span_tokens == 64 and written.info.block_size == backend.block_size

    sent = len(backend.done)
    again = run_preload(EXAMPLES, backend, manifest, span_tokens=64)
    assert again.ok and again.count(STORED) == again.spans and again.count(NEW) == 0
    assert len(backend.done) == sent + again.spans  # one probe each, one token of work

    trusted = run_preload(EXAMPLES, backend, manifest, span_tokens=64, trust_manifest=True)
    assert trusted.trusted_from_manifest == trusted.spans == trusted.count(STORED)
    assert len(backend.done) == sent + again.spans  # no request at all
    assert "0 new" in format_summary(trusted)


def test_bad_inputs_are_reported_and_the_rest_preloaded(tokenizer, tmp_path):
    corpus = tmp_path / "corpus"
    shutil.copytree(EXAMPLES, corpus)
    (corpus / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (corpus / "empty.md").write_text("")
    (corpus / "marker.txt").write_text("a <|reserved_special_token_0|> inside the text")
    (corpus / "rivers.jsonl").open("a").write('{"title": "no text"}\n')
    report = run_preload(corpus, FakeBackend(tokenizer=tokenizer, delay_s=0),
                         tmp_path / "m.parquet")
    assert not report.ok and report.documents == len(EXAMPLE_IDS)
    assert {p.where for p in report.problems} == {"latin1.txt", "empty.md", "marker.txt",
                                                  "rivers.jsonl:4"}
    listed = format_problems(report)
    assert "latin1.txt: not UTF-8" in listed and "SSep" in listed
    assert sorted(Manifest.read(tmp_path / "m.parquet").doc_ids()) == EXAMPLE_IDS


def test_a_failed_span_is_recorded_and_retried(tokenizer, tmp_path):
    [capital] = tokenizer.encode("capital", add_special_tokens=False)  # paris.md, rome.txt
    failing = FakeBackend(tokenizer=tokenizer, delay_s=0, fail_if=lambda p: capital in p)
    report = run_preload(EXAMPLES, failing, tmp_path / "m.parquet")
    assert not report.ok and report.count(FAILED) == 2
    failed = [r for r in Manifest.read(tmp_path / "m.parquet").records if r.status == FAILED]
    assert failed and all("refused by the fake engine" in r.error for r in failed)
    assert {r.doc_id for r in failed} == {"cities/paris.md", "cities/rome.txt"}
    assert [f.where for f in report.failed_spans] == ["cities/paris.md span 0",
                                                      "cities/rome.txt span 0"]

    failing.fail_if = lambda p: False  # the engine is fine again: only the failures are new
    again = run_preload(EXAMPLES, failing, tmp_path / "m.parquet")
    assert again.ok and again.count(NEW) == report.count(FAILED)


def test_an_interrupted_run_still_writes_its_manifest(tokenizer, tmp_path):
    backend = FakeBackend(tokenizer=tokenizer, delay_s=0.05)

    async def interrupted():
        task = asyncio.ensure_future(preload(EXAMPLES, backend, progress=False, concurrency=1,
                                             manifest_path=tmp_path / "m.parquet", span_tokens=64))
        await asyncio.sleep(0.12)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(interrupted())
    statuses = [r.status for r in Manifest.read(tmp_path / "m.parquet").records]
    assert NEW in statuses and PENDING in statuses


@pytest.mark.parametrize("corpus", ["empty", "mistyped"])
def test_a_run_that_reads_nothing_keeps_the_manifest(tokenizer, tmp_path, corpus):
    from minipic.client.preload.pipeline import NothingToPreload

    backend, manifest = FakeBackend(tokenizer=tokenizer, delay_s=0), tmp_path / "m.parquet"
    run_preload(EXAMPLES, backend, manifest)
    (tmp_path / "empty").mkdir()
    with pytest.raises(NothingToPreload, match="no document could be read"):
        run_preload(tmp_path / corpus, backend, manifest)
    assert sorted(Manifest.read(manifest).doc_ids()) == EXAMPLE_IDS


def test_a_run_over_part_of_a_corpus_adds_to_the_manifest(tokenizer, tmp_path):
    backend, manifest = FakeBackend(tokenizer=tokenizer, delay_s=0), tmp_path / "m.parquet"
    run_preload(EXAMPLES, backend, manifest)
    part = run_preload(EXAMPLES / "cities", backend, manifest)
    assert part.ok and part.count(STORED) == part.spans  # the same spans, other document ids
    assert sorted(Manifest.read(manifest).doc_ids()) == sorted(EXAMPLE_IDS + ["paris.md",
                                                                             "rome.txt"])


def test_a_manifest_of_another_layout_is_never_overwritten(tokenizer, tmp_path):
    from minipic.client.preload.manifest import ManifestError

    backend, manifest = FakeBackend(tokenizer=tokenizer, delay_s=0), tmp_path / "m.parquet"
    run_preload(EXAMPLES, backend, manifest, span_tokens=64)
    sent = len(backend.done)
    with pytest.raises(ManifestError, match="give another --manifest"):
        run_preload(EXAMPLES, backend, manifest, span_tokens=128)
    assert len(backend.done) == sent  # refused before any work
    assert Manifest.read(manifest).info.span_tokens == 64


def test_an_unwritable_manifest_fails_before_any_work(tokenizer, tmp_path):
    backend = FakeBackend(tokenizer=tokenizer, delay_s=0)
    with pytest.raises(OSError):
        run_preload(EXAMPLES, backend, tmp_path / "no-such-dir" / "m.parquet")
    assert not backend.done


def test_a_manifest_that_cannot_be_written_at_the_end_is_reported(tokenizer, tmp_path,
                                                                  monkeypatch):
    def disk_full(self, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Manifest, "write", disk_full)
    report = run_preload(EXAMPLES, FakeBackend(tokenizer=tokenizer, delay_s=0),
                         tmp_path / "m.parquet")
    assert not report.ok and report.count(NEW) == report.spans  # the work itself is kept
    assert "NOT written" in format_summary(report) and "No space left" in format_summary(report)


def test_spans_longer_than_the_engine_takes_are_refused_up_front(tokenizer, tmp_path):
    from minipic.client.prompts.span_prompt import SpanPromptError

    backend = FakeBackend(tokenizer=tokenizer, delay_s=0)
    backend.max_model_len = 64
    with pytest.raises(SpanPromptError, match="--span-tokens 62 or less"):
        run_preload(EXAMPLES, backend, tmp_path / "m.parquet", span_tokens=64)
    assert not backend.done and not (tmp_path / "m.parquet").exists()
    assert run_preload(EXAMPLES, backend, tmp_path / "m.parquet", span_tokens=62).ok


def test_rag_client_hits_what_preload_stored(tokenizer, tmp_path):
    backend = FakeBackend(tokenizer=tokenizer, delay_s=0)
    run_preload(EXAMPLES, backend, tmp_path / "m.parquet")
    client = RagClient(backend, system="you are a helpful assistant .",
                       manifest=Manifest.read(tmp_path / "m.parquet"))
    question, refs = "what is the capital of france ?", [DocRef("rivers.jsonl#nile"),
                                                          DocRef("cities/paris.md")]
    texts = [(EXAMPLES / "rivers.jsonl").read_text().splitlines()[0],
             (EXAMPLES / "cities" / "paris.md").read_text()]

    async def ask():
        alone = await client.ask("who wrote it ?", refs, prefill_spans=False)
        by_id = await client.ask(question, refs)
        return alone, by_id

    alone, by_id = asyncio.run(ask())
    # Hits run from block 0: with the system prompt never prefilled, nothing hits.
    assert alone.cached_tokens == 0 < alone.expected_cached_tokens
    # With spans prefilled first (the header for real, the documents by a one-token probe).
    # The first question computed the EPIC links of these documents in this order: they
    # hit too, on top of what the prefills alone give.
    final = by_id.request.prompt.final
    links = final.index(client.protocol.pdep_token_id) - final.index(client.protocol.link_token_id)
    assert by_id.cached_tokens == by_id.expected_cached_tokens + links
    assert all(s.already_stored for s in by_id.spans)
    # Text cut by the client is token for token what preload stored.
    import json
    nile = json.loads(texts[0])["text"]
    assert client.prompt(question, [nile, texts[1]]) == by_id.request.prompt


def test_rag_client_refuses_a_manifest_made_for_other_markers(tokenizer, tmp_path):
    from minipic.client.preload.manifest import ManifestError, ManifestInfo
    from minipic.protocol import SpanProtocol

    backend = FakeBackend(tokenizer=tokenizer, delay_s=0)
    run_preload(EXAMPLES, backend, tmp_path / "m.parquet")
    made = Manifest.read(tmp_path / "m.parquet")
    foreign = Manifest(ManifestInfo(made.info.model, made.info.block_size, made.info.span_tokens,
                                    SpanProtocol(7, 8, 9)), made.records)
    with pytest.raises(ManifestError, match="differs from the engine's"):
        RagClient(backend, manifest=foreign)


def test_rag_client_recipes_are_the_servers(tokenizer):
    """One name, one meaning: RagClient takes the server's recipe names (epic64 the
    default, epic one block, epic2 two), an amount overrides an EPIC recipe's, and what
    cannot hold together is refused."""
    from minipic.client.prompts.recipes import RECIPES_BY_NAME
    from minipic.client.prompts.span_prompt import SpanPromptError

    backend = FakeBackend(tokenizer=tokenizer, delay_s=0)
    docs, question = ["the nile is a river . " * 8], "what is the nile ?"
    for name in RECIPES_BY_NAME:
        client = RagClient(backend, recipe=name)
        spans = client.spans(docs[0])
        expected = RECIPES_BY_NAME[name](spans, question, system=None, protocol=client.protocol,
                                         block_size=client.block_size, tokenizer=client.tokenizer)
        assert client.prompt(question, docs) == expected
    assert RagClient(backend).recipe == "epic64"
    two = RagClient(backend, recompute_blocks=2).prompt(question, docs)
    assert two == RagClient(backend, recipe="epic2").prompt(question, docs)
    with pytest.raises(SpanPromptError, match="not both"):
        RagClient(backend, recompute_blocks=2, recompute_tokens=64)
    with pytest.raises(SpanPromptError, match="block_attention recomputes nothing"):
        RagClient(backend, recipe="block_attention", recompute_blocks=1)
    with pytest.raises(SpanPromptError, match="recipe must be one of"):
        RagClient(backend, recipe="epic3")
