"""Preload a corpus: documents -> spans -> prefilled into the engine's span store.

Runs in the client process (minipic-preload, or any Python caller).

The steps of `minipic-preload`, usable from Python with any backend:

    report = await preload("corpus/", backend, manifest_path="m.parquet")

1. read the corpus (corpus.py); a bad file or record becomes a problem, never a crash;
2. cut every document into spans (document_spans.py); identical spans are prefilled once;
3. prefill the spans, `concurrency` at a time, each learning whether it was
   already stored (span_prefill.py), so a re-run redoes no work: a stored span
   costs one token; with `trust_manifest` it costs no request at all;
   against a minipic server (a backend with `server_settings`, i.e. an
   OpenAIServerBackend connected without trust_server), steps 2 and 3 are the
   server's: each document goes as text to POST /v1/minipic/preload, `concurrency`
   documents at a time, and its spans come back (on_server.py), so no tokenizer
   is loaded here;
4. write the manifest (manifest.py), also when interrupted: what was stored stays
   stored in the engine, and the manifest says which spans got there. An
   existing manifest for the same layout keeps the documents this run did not
   read (a run over part of a corpus adds to it); one for another layout, or a
   manifest that cannot be written, stops the run before any work.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from typing import Any

from tqdm.auto import tqdm

from minipic.client.backends.base import CompletionBackend
from minipic.client.preload.corpus import CorpusProblem, Document, IgnoredFile, iter_corpus
from minipic.client.prompts.document_spans import DEFAULT_SPAN_TOKENS, document_spans, span_key, span_window
from minipic.client.preload.manifest import (
    FAILED, NEW, PENDING, PREFILLED, STORED, Manifest, ManifestError, ManifestInfo, SpanRecord,
)
from minipic.client.preload.on_server import ServerRun, one_outcome_per_span, preload_on_server
from minipic.client.span_prefill import SpanPrefill, prefill_span
from minipic.client.prompts.span_prompt import SpanPromptError


@dataclasses.dataclass
class PreloadReport:
    documents: int = 0
    spans: int = 0  # distinct spans
    tokens: int = 0  # tokens of the distinct spans
    status_counts: dict[str, int] = dataclasses.field(default_factory=dict)
    trusted_from_manifest: int = 0  # spans skipped without a request
    problems: list[CorpusProblem] = dataclasses.field(default_factory=list)
    failed_spans: list[CorpusProblem] = dataclasses.field(default_factory=list)
    ignored_files: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    manifest_path: str | None = None
    manifest_error: str | None = None  # the manifest could not be written at the end

    @property
    def ok(self) -> bool:
        """Nothing was skipped for a problem, nothing failed, and the manifest was written."""
        return (not self.problems and not self.failed_spans and not self.count(PENDING)
                and not self.manifest_error)

    def count(self, status: str) -> int:
        return self.status_counts.get(status, 0)


class NothingToPreload(ValueError):
    """The corpus gave no document: a run must not replace a manifest with an empty one."""


@dataclasses.dataclass
class _Work:
    """Everything one run prefills: records per document span, distinct spans by key."""

    records: list[SpanRecord]
    spans: dict[str, list[int]]


async def preload(corpus: str | os.PathLike, backend: CompletionBackend, *,
                  manifest_path: str | os.PathLike | None = "minipic-manifest.parquet",
                  span_tokens: int = DEFAULT_SPAN_TOKENS, concurrency: int = 32,
                  text_field: str = "text", id_field: str | None = None,
                  trust_manifest: bool = False, progress: bool = True) -> PreloadReport:
    started = time.monotonic()
    info = _manifest_info(backend, span_tokens)
    report = PreloadReport(manifest_path=None if manifest_path is None else str(manifest_path))
    previous = None
    if manifest_path is not None:
        previous = _previous_manifest(manifest_path, info)
        Manifest.check_writable(manifest_path)
    trusted = previous if trust_manifest else None
    documents = _documents_of_corpus(corpus, text_field, id_field, report)
    on_server = getattr(backend, "server_settings", None) is not None
    work = None if on_server else _spans_of_documents(documents, backend.get_tokenizer(),
                                                       info, report)
    if not (documents if on_server else work.records):
        raise NothingToPreload(_nothing_read(corpus, report))
    records: list[SpanRecord] = []  # filled also when the run stops early
    try:
        if on_server:
            await _preload_on_server(backend, documents, info, trusted, records, report,
                                     concurrency, progress)
        else:
            await _preload_token_ids(backend, work, info, trusted, records, report,
                                     concurrency, progress)
    finally:
        _summarise(report, records, started)
        if manifest_path is not None:
            _write_manifest(Manifest(info, records + _untouched(previous, records)),
                            manifest_path, report)
    return report


async def _preload_token_ids(backend: CompletionBackend, work: _Work, info: ManifestInfo,
                             trusted: Manifest | None, records: list[SpanRecord],
                             report: PreloadReport, concurrency: int, progress: bool) -> None:
    """Spans cut here (the backend's tokenizer), prefilled as token-id prompts."""
    outcomes: dict[str, SpanPrefill | str] = {}  # by span key; str: a status without a request
    if trusted is not None:
        outcomes.update({k: STORED for k in trusted.keys_with_status(NEW, STORED, PREFILLED)})
        report.trusted_from_manifest = sum(1 for k in work.spans if k in outcomes)
    try:
        todo = {k: s for k, s in work.spans.items() if k not in outcomes}
        await _prefill_all(backend, info, todo, outcomes, concurrency, progress)
    finally:
        records.extend(_with_outcome(r, outcomes.get(r.span_key)) for r in work.records)


async def _preload_on_server(backend: Any, documents: list[Document], info: ManifestInfo,
                             trusted: Manifest | None, records: list[SpanRecord],
                             report: PreloadReport, concurrency: int, progress: bool) -> None:
    """Documents sent as text; the server cuts and prefills them (on_server.py)."""
    run = ServerRun()
    trusted_keys: dict[str, set[str]] = {}
    if trusted is not None:
        for r in trusted.records:
            if r.status in (NEW, STORED, PREFILLED):
                trusted_keys.setdefault(r.doc_id, set()).add(r.span_key)
    try:
        await preload_on_server(backend, documents, info, run, trusted_keys=trusted_keys,
                                concurrency=concurrency, progress=progress)
    finally:
        records.extend(one_outcome_per_span(run.records))
        report.documents += len({r.doc_id for r in run.records})
        report.problems.extend(run.problems)
        report.trusted_from_manifest = len(run.trusted_keys)


def _write_manifest(manifest: Manifest, path: Any, report: PreloadReport) -> None:
    """A write that fails (e.g. the disk filled up during the run) is reported with the
    run's summary; the spans are stored in the engine all the same, and the previous
    manifest, if any, is left as it was."""
    try:
        manifest.write(path)
    except OSError as e:
        report.manifest_error = f"{type(e).__name__}: {e}"


def _previous_manifest(manifest_path: Any, info: ManifestInfo) -> Manifest | None:
    """The manifest a run adds to; one written for another layout is never overwritten."""
    if not os.path.exists(manifest_path):
        return None
    previous = Manifest.read(manifest_path)
    if previous.info != info:
        raise ManifestError(f"{manifest_path} was written for {previous.info}, not {info}: "
                            "give another --manifest, or remove that file")
    return previous


def _untouched(previous: Manifest | None, records: list[SpanRecord]) -> list[SpanRecord]:
    """The previous manifest's documents that this run did not read."""
    if previous is None:
        return []
    read = {r.doc_id for r in records}
    return [r for r in previous.records if r.doc_id not in read]


def _nothing_read(corpus: Any, report: PreloadReport) -> str:
    problems = "; ".join(str(p) for p in report.problems[:3])
    return (f"no document could be read from {corpus}"
            + (f" ({len(report.problems)} problems: {problems})" if problems else "")
            + (f" ({len(report.ignored_files)} files of other kinds ignored)"
               if report.ignored_files else ""))


def _manifest_info(backend: CompletionBackend, span_tokens: int) -> ManifestInfo:
    if backend.block_size is None:
        raise SpanPromptError("the engine's KV block size is unknown: pass it (--block-size)")
    window = span_window(span_tokens, backend.block_size)
    limit = getattr(backend, "max_model_len", None)
    # A span prefill is the span + one probe token, and vLLM needs room for one more.
    if limit is not None and window + 2 > limit:
        raise SpanPromptError(
            f"spans of {window} tokens do not fit the engine's max_model_len {limit} (a span "
            f"prefill sends the span, one probe token and generates one): use --span-tokens "
            f"{limit - 2} or less")
    return ManifestInfo(model=backend.model, block_size=backend.block_size, span_tokens=window,
                        protocol=backend.span_protocol())


def _documents_of_corpus(corpus: Any, text_field: str, id_field: str | None,
                         report: PreloadReport) -> list[Document]:
    documents = []
    for item in iter_corpus(corpus, text_field=text_field, id_field=id_field):
        if isinstance(item, IgnoredFile):
            report.ignored_files.append(item.source)
        elif isinstance(item, CorpusProblem):
            report.problems.append(item)
        else:
            documents.append(item)
    return documents


def _spans_of_documents(documents: list[Document], tokenizer: Any, info: ManifestInfo,
                        report: PreloadReport) -> _Work:
    work = _Work([], {})
    for document in documents:
        _add_document(work, document, tokenizer, info, report)
    return work


def _add_document(work: _Work, doc: Document, tokenizer: Any, info: ManifestInfo,
                  report: PreloadReport) -> None:
    try:
        spans = document_spans(doc.text, protocol=info.protocol, block_size=info.block_size,
                               span_tokens=info.span_tokens, tokenizer=tokenizer,
                               where=doc.doc_id)
    except SpanPromptError as e:  # e.g. the text spells out a marker token
        report.problems.append(CorpusProblem(doc.doc_id, str(e)))
        return
    report.documents += 1
    for index, span in enumerate(spans):
        key = span_key(span)
        work.spans.setdefault(key, span)
        work.records.append(SpanRecord(doc.doc_id, doc.source, index, len(spans), key, span))


async def _prefill_all(backend: CompletionBackend, info: ManifestInfo,
                       spans: dict[str, list[int]], outcomes: dict[str, Any],
                       concurrency: int, progress: bool) -> None:
    queue: asyncio.Queue = asyncio.Queue()
    for item in spans.items():
        queue.put_nowait(item)
    total_tokens = sum(len(s) for s in spans.values())
    bar = tqdm(total=len(spans), unit="span", disable=not progress, dynamic_ncols=True)
    started, done_tokens = time.monotonic(), 0

    async def worker() -> None:
        nonlocal done_tokens
        while not queue.empty():
            key, span = queue.get_nowait()
            try:
                outcomes[key] = await prefill_span(backend, span, info.protocol)
            except Exception as e:  # recorded per span; the others go on
                outcomes[key] = e
            done_tokens += len(span)
            bar.update(1)
            rate = done_tokens / max(time.monotonic() - started, 1e-9)
            bar.set_postfix_str(f"{rate:,.0f} tok/s, {done_tokens:,}/{total_tokens:,} tok",
                                refresh=False)

    workers = [asyncio.ensure_future(worker()) for _ in range(max(1, concurrency))]
    try:
        await asyncio.gather(*workers)
    finally:
        for w in workers:
            w.cancel()
        bar.close()


def _with_outcome(record: SpanRecord, outcome: SpanPrefill | BaseException | str | None
                  ) -> SpanRecord:
    if outcome is None:
        return record  # pending: the run stopped first
    if isinstance(outcome, str):
        return dataclasses.replace(record, status=outcome)
    if isinstance(outcome, BaseException):
        return dataclasses.replace(record, status=FAILED,
                                   error=f"{type(outcome).__name__}: {outcome}")
    status = {None: PREFILLED, True: STORED, False: NEW}[outcome.already_stored]
    return dataclasses.replace(record, status=status, cached_tokens=outcome.cached_tokens)


def _summarise(report: PreloadReport, records: list[SpanRecord], started: float) -> None:
    by_key = {r.span_key: r for r in records}
    report.spans = len(by_key)
    report.tokens = sum(len(r.token_ids) for r in by_key.values())
    for record in by_key.values():
        report.status_counts[record.status] = report.status_counts.get(record.status, 0) + 1
    report.failed_spans = [CorpusProblem(f"{r.doc_id} span {r.span_index}", r.error or "failed")
                           for r in records if r.status == FAILED]
    report.seconds = time.monotonic() - started
