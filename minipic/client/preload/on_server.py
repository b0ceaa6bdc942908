"""Preload over HTTP: documents go to the server as text; it cuts and prefills them.

Runs in the client process (minipic-preload --url).

The pipeline's path for a backend connected to a minipic server's settings
(`OpenAIServerBackend.server_settings`): each document is one request to
POST /v1/minipic/preload, `concurrency` in flight, and the manifest's records are
built from the server's answers (span keys, token ids, statuses), so this
process loads no tokenizer and cannot cut spans differently from the server's
chat `documents`. A document the server refuses (HTTP 400: e.g. it spells a
marker token) becomes a problem naming it, as a local cutting error does; a
request that fails otherwise becomes a problem too, and a re-run retries it.
With `trusted_keys` (--trust-manifest) the spans the previous manifest lists as
stored for a document are sent as `skip_span_keys`: cut, recorded, not prefilled.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from tqdm.auto import tqdm

from minipic.client.backends.server_preload import DocumentRefusedError, PreloadedSpan
from minipic.client.backends.server_settings import (NotAMinipicServerError,
                                                     SettingsDisagreeError)
from minipic.client.preload.corpus import CorpusProblem, Document
from minipic.client.preload.manifest import FAILED, NEW, STORED, ManifestInfo, SpanRecord

# The route's span statuses as the manifest records them ("skipped": trusted as stored).
MANIFEST_STATUS = {"new": NEW, "stored": STORED, "skipped": STORED, "failed": FAILED}


@dataclasses.dataclass
class ServerRun:
    """What the server answered so far; read also when the run stopped early."""

    records: list[SpanRecord] = dataclasses.field(default_factory=list)
    problems: list[CorpusProblem] = dataclasses.field(default_factory=list)
    answered: set[str] = dataclasses.field(default_factory=set)  # document ids
    trusted_keys: set[str] = dataclasses.field(default_factory=set)  # skipped by the server


async def preload_on_server(backend: Any, documents: list[Document], info: ManifestInfo,
                            run: ServerRun, *, trusted_keys: dict[str, set[str]],
                            concurrency: int, progress: bool) -> None:
    """Send every document, `concurrency` at a time, filling `run` as answers come."""
    queue: asyncio.Queue = asyncio.Queue()
    for document in documents:
        queue.put_nowait(document)
    bar = tqdm(total=len(documents), unit="doc", disable=not progress, dynamic_ncols=True)

    async def worker() -> None:
        while not queue.empty():
            document = queue.get_nowait()
            await _preload_one(backend, document, info, run,
                               trusted_keys.get(document.doc_id, set()))
            bar.update(1)

    workers = [asyncio.ensure_future(worker()) for _ in range(max(1, concurrency))]
    try:
        await asyncio.gather(*workers)
    finally:
        for w in workers:
            w.cancel()
        bar.close()
        run.problems.extend(CorpusProblem(d.doc_id, "not preloaded: the run stopped first")
                            for d in documents if d.doc_id not in run.answered)


async def _preload_one(backend: Any, document: Document, info: ManifestInfo, run: ServerRun,
                       skip: set[str]) -> None:
    try:
        [spans] = await backend.preload_documents([document.text],
                                                  span_tokens=info.span_tokens,
                                                  skip_span_keys=skip)
    except (NotAMinipicServerError, SettingsDisagreeError):
        raise  # the whole run stops: no document could be preloaded as recorded
    except DocumentRefusedError as e:
        run.problems.append(CorpusProblem(document.doc_id, f"refused by the server: {e}"))
    except Exception as e:  # recorded per document; the others go on
        run.problems.append(CorpusProblem(document.doc_id,
                                          f"preload failed: {type(e).__name__}: {e}"))
    else:
        run.records.extend(_records(document, spans))
        run.trusted_keys.update(s.span_key for s in spans if s.status == "skipped")
    run.answered.add(document.doc_id)


def _records(document: Document, spans: list[PreloadedSpan]) -> list[SpanRecord]:
    return [SpanRecord(document.doc_id, document.source, index, len(spans), span.span_key,
                       span.token_ids, MANIFEST_STATUS[span.status], span.cached_tokens,
                       span.error)
            for index, span in enumerate(spans)]


def one_outcome_per_span(records: list[SpanRecord]) -> list[SpanRecord]:
    """Records of one span (documents sharing it) as one outcome, as the local path has:
    new if any request computed it, else stored, else failed."""
    rank = {NEW: 0, STORED: 1, FAILED: 2}
    best: dict[str, SpanRecord] = {}
    for record in records:
        kept = best.get(record.span_key)
        if kept is None or rank.get(record.status, 3) < rank.get(kept.status, 3):
            best[record.span_key] = record
    return [dataclasses.replace(r, status=best[r.span_key].status,
                                cached_tokens=best[r.span_key].cached_tokens,
                                error=best[r.span_key].error) for r in records]
