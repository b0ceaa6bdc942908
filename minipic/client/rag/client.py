"""A span-aware RAG client: system prompt + documents + question -> an answer from cached spans.

    backend = AsyncLLMBackend(async_llm)  # or await OpenAIServerBackend.connect(url)
    client = RagClient(backend, system="Answer from the documents.",
                       manifest=Manifest.read("minipic-manifest.parquet"))
    answer = await client.ask("Who wrote it?", [DocRef("books/tale.md"), "retrieved text ..."])
    answer.text, answer.cached_tokens, answer.expected_cached_tokens

Documents are given as text (cut into spans exactly as `minipic-preload`
cuts them, so preloaded text hits) or as `DocRef`s to a preload manifest
(its stored token ids, no re-tokenizing). The final prompt is, with the default
recipe "epic64" (EPIC: right answers from models not fine-tuned for block attention; the
first 64 tokens of each document recomputed in context, in whole blocks, as 32 were not
enough on a small model, docs/accuracy.md; `recompute_tokens=` or `recompute_blocks=`
for another amount; the recipe names are the server's, "epic" one block, "epic2" two),
[BOS system pad][SSep span pad]...[link span head]...[PDep question], and with
recipe="block_attention" (models fine-tuned for it) the same without the links.
Both reuse the same preloaded spans. `ask` first prefills the
request's spans through ISPS (a stored span costs one token, see
span_prefill.py), then sends the final prompt; for many questions, hand
`client.request(...)`s to `InterleavedScheduler` or `BatchedScheduler`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Sequence, Union

from minipic.client.backends.base import CompletionBackend
from minipic.client.prompts.document_spans import DEFAULT_SPAN_TOKENS, document_spans
from minipic.client.rag.isps import InterleavedScheduler
from minipic.client.preload.manifest import Manifest, ManifestError
from minipic.client.rag.request import RagRequest, RagResult
from minipic.client.prompts.recipes import RECIPES_BY_NAME, epic, refuse_both_amounts
from minipic.config import DEFAULT_SERVER_RECIPE
from minipic.client.prompts.span_prompt import SpanPrompt, SpanPromptError
from minipic.protocol import SpanProtocol

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DocRef:
    """A document by its id in the preload manifest (its preloaded spans)."""

    doc_id: str


Doc = Union[str, DocRef, Sequence[int]]  # text, a manifest id, or token ids
# The server's recipe names (client.prompts.recipes.RECIPES_BY_NAME), meaning the same here.
RECIPES = tuple(RECIPES_BY_NAME)
DEFAULT_RECIPE = DEFAULT_SERVER_RECIPE


class RagClient:
    def __init__(self, backend: CompletionBackend, *, system: str | None = None,
                 manifest: Manifest | None = None, block_size: int | None = None,
                 span_tokens: int | None = None, tokenizer: Any = None,
                 protocol: SpanProtocol | None = None, max_tokens: int = 64,
                 temperature: float = 0.0, max_in_flight: int = 16,
                 recipe: str = DEFAULT_RECIPE, recompute_tokens: int | None = None,
                 recompute_blocks: int | None = None):
        if recipe not in RECIPES:
            raise SpanPromptError(f"recipe must be one of {RECIPES}, got {recipe!r}")
        overrides = {k: v for k, v in (("recompute_tokens", recompute_tokens),
                                       ("recompute_blocks", recompute_blocks)) if v is not None}
        if overrides and recipe == "block_attention":
            raise SpanPromptError(f"{', '.join(overrides)}: block_attention recomputes nothing")
        refuse_both_amounts(recompute_blocks, recompute_tokens)
        self.recipe, self.overrides = recipe, overrides
        self.backend = backend
        self.system = system
        self.manifest = manifest
        info = manifest.info if manifest else None
        self.tokenizer = tokenizer or backend.get_tokenizer()
        # The engine's markers, not the manifest's: a manifest made for another engine
        # must be refused, not followed.
        self.protocol = protocol or backend.span_protocol()
        if info and info.protocol != self.protocol:
            raise ManifestError(f"the manifest's span protocol {info.protocol} differs from "
                                f"the engine's {self.protocol}: its spans would never hit")
        if info and backend.model and info.model != backend.model:
            logger.warning("the manifest was made for model %r, the engine serves %r: its "
                           "spans hit only if both tokenize alike", info.model, backend.model)
        self.block_size = _agreed_block_size(block_size, backend.block_size,
                                             info.block_size if info else None)
        self.span_tokens = span_tokens or (info.span_tokens if info else DEFAULT_SPAN_TOKENS)
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.max_in_flight = max_in_flight

    def spans(self, doc: Doc, where: str = "document") -> list[list[int]]:
        """A document's spans, as preload would make them (or as the manifest has them)."""
        if isinstance(doc, DocRef):
            if self.manifest is None:
                raise SpanPromptError(f"{doc} needs a manifest: pass RagClient(manifest=...)")
            return self.manifest.spans_of(doc.doc_id)
        return document_spans(doc, protocol=self.protocol, block_size=self.block_size,
                              span_tokens=self.span_tokens, tokenizer=self.tokenizer,
                              where=where)

    def prompt(self, question: str | Sequence[int], docs: Sequence[Doc]) -> SpanPrompt:
        if isinstance(docs, (str, DocRef)):
            raise SpanPromptError("docs must be a list of documents")
        spans = [s for i, doc in enumerate(docs) for s in self.spans(doc, f"document {i}")]
        common = dict(system=self.system, protocol=self.protocol, block_size=self.block_size,
                      tokenizer=self.tokenizer)
        if self.overrides:  # an EPIC recipe with another recompute amount
            return epic(spans, question, **self.overrides, **common)
        return RECIPES_BY_NAME[self.recipe](spans, question, **common)

    def request(self, question: str | Sequence[int], docs: Sequence[Doc], *,
                max_tokens: int | None = None, metadata: Any = None) -> RagRequest:
        return RagRequest(self.prompt(question, docs),
                          max_tokens=self.max_tokens if max_tokens is None else max_tokens,
                          temperature=self.temperature,
                          metadata=question if metadata is None else metadata)

    async def ask(self, question: str | Sequence[int], docs: Sequence[Doc], *,
                  prefill_spans: bool = True, max_tokens: int | None = None) -> RagResult:
        """Answer one question; raises if its spans or its final prompt fail.

        prefill_spans=False sends the final prompt alone. It only hits if every
        span, the system-prompt header included, is already cached: vLLM's hits
        run from the first block and stop at the first miss. Misses still
        answer, just slower.
        """
        request = self.request(question, docs, max_tokens=max_tokens)
        if prefill_spans:
            scheduler = InterleavedScheduler(self.backend, self.protocol,
                                             max_in_flight=self.max_in_flight)
            [result] = await scheduler.run([request])
        else:
            arrived_at = time.monotonic()
            completion = await self.backend.complete(request.prompt.final,
                                                     max_tokens=request.max_tokens,
                                                     temperature=request.temperature)
            result = RagResult(request, completion, None, (), arrived_at)
        if result.error is not None:
            raise result.error
        return result


def _agreed_block_size(*candidates: int | None) -> int:
    """The first given block size (argument, engine, manifest); all given must agree."""
    given = [c for c in candidates if c is not None]
    if not given:
        raise SpanPromptError(
            "block_size is unknown: pass the server's KV block size (RagClient(block_size=...) "
            "or OpenAIServerBackend.connect(block_size=...)), or a manifest")
    if len(set(given)) > 1:
        raise SpanPromptError(f"block sizes disagree (argument, engine, manifest): {candidates}")
    return given[0]
