"""RAG recipes: Block-Attention and EPIC prompts from documents and a task.

Both lay the final prompt out as
    [BOS + system + pad] [document 0] [document 1] ... [PDep + task]
and differ only in how a document is laid out. The header (when there is a
BOS or a system prompt) is chained normally from block 0 and is a prefill
request of its own, so it hits too; the task is never padded (generation
follows it) and never hits (PDep).
"""

from __future__ import annotations

from typing import Any, Sequence

from minipic.client.span_prompt import (
    SpanPrompt, SpanPromptError, TextOrTokens, bos_of, check_block_size, check_body,
    make_header, make_span, make_task, pad_to_block, span_from, to_tokens,
)
from minipic.protocol import SpanProtocol


def _check_docs(docs: Any) -> Sequence[TextOrTokens]:
    # A lone string would otherwise be read as one document per character.
    if isinstance(docs, str) or not isinstance(docs, Sequence):
        raise SpanPromptError("docs must be a list of documents (text or token ids)")
    return docs


def _header(system: TextOrTokens | None, tokenizer: Any, protocol: SpanProtocol,
            block_size: int) -> list[int]:
    system_tokens = [] if system is None else to_tokens(system, tokenizer, "system prompt")
    return make_header(system_tokens, bos_of(tokenizer), protocol, block_size)


def _assemble(header: list[int], doc_parts: list[list[int]], doc_prefills: list[list[int]],
              task: TextOrTokens, tokenizer: Any, protocol: SpanProtocol,
              block_size: int) -> SpanPrompt:
    task_tokens = make_task(to_tokens(task, tokenizer, "task"), protocol)
    final = header + [t for part in doc_parts for t in part] + task_tokens
    prefills = ([header] if header else []) + doc_prefills
    return SpanPrompt.build(prefills, final, protocol, block_size)


def block_attention(docs: Sequence[TextOrTokens], task: TextOrTokens, *,
                    protocol: SpanProtocol, block_size: int,
                    system: TextOrTokens | None = None, tokenizer: Any = None) -> SpanPrompt:
    """[BOS + system + pad] [SSep d0 pad] [SSep d1 pad] ... [PDep task].

    Every document is an SSep span, prefilled alone and hit at any offset.
    A document given as token ids starting with SSep is taken as a pre-built span.
    """
    block_size = check_block_size(block_size)
    spans = [span_from(doc, protocol, block_size, tokenizer, f"document {i}")
             for i, doc in enumerate(_check_docs(docs))]
    header = _header(system, tokenizer, protocol, block_size)
    return _assemble(header, spans, spans, task, tokenizer, protocol, block_size)


def epic_document(body: Sequence[int], recompute_blocks: int, protocol: SpanProtocol,
                  block_size: int, where: str = "document") -> tuple[list[int], list[int] | None]:
    """(recomputed head, SSep span or None) for one EPIC document.

    The head is [PDep + first recompute_blocks*block_size - 1 tokens]: exactly
    recompute_blocks blocks. It must start with PDep, not chain plainly: its
    predecessor is usually the previous document's last SSep block, whose hash
    covers that document only, so a plainly chained head would hit a head
    computed after a different system prompt or earlier documents (a false hit
    with wrong KV). PDep makes the head's hash, and through the chain the hash
    of its later blocks, commit to everything before it. The rest of the
    document is an ordinary span: [SSep + rest + pad], prefilled alone.
    A document that fits in the head has no span; its head is padded instead.
    """
    block_size = check_block_size(block_size)
    _check_recompute_blocks(recompute_blocks)
    if not body:
        raise SpanPromptError(f"{where} is empty")
    check_body(body, protocol, where)
    if recompute_blocks == 0:
        return [], make_span(body, protocol, block_size, where)
    head_len = recompute_blocks * block_size - 1  # PDep takes the head's first slot
    head = [protocol.pdep_token_id, *body[:head_len]]
    rest = body[head_len:]
    if not rest:
        return pad_to_block(head, block_size, protocol.pad_token_id), None
    return head, make_span(rest, protocol, block_size, where)


def _check_recompute_blocks(recompute_blocks: Any) -> None:
    if isinstance(recompute_blocks, bool) or not isinstance(recompute_blocks, int) \
            or recompute_blocks < 0:
        raise SpanPromptError(f"recompute_blocks must be an int >= 0, got {recompute_blocks!r}")


def epic(docs: Sequence[TextOrTokens], task: TextOrTokens, *, protocol: SpanProtocol,
         block_size: int, recompute_blocks: int = 1, system: TextOrTokens | None = None,
         tokenizer: Any = None) -> SpanPrompt:
    """[BOS + system + pad] [PDep d0 head][SSep d0 rest pad] ... [PDep task].

    The first recompute_blocks blocks of each document are recomputed in the
    final prompt (EPIC's "first k tokens", rounded to blocks), the rest hits.
    Note that vLLM's prefix cache stops at the first miss, so with stock
    lookups only the header hits; the span blocks are cached and identical for
    any lookup that is not prefix-only (e.g. a KV connector).
    """
    block_size = check_block_size(block_size)
    _check_recompute_blocks(recompute_blocks)
    parts: list[list[int]] = []
    spans: list[list[int]] = []
    for i, doc in enumerate(_check_docs(docs)):
        where = f"document {i}"
        body = to_tokens(doc, tokenizer, where)
        if not isinstance(doc, str) and body[:1] == [protocol.ssep_token_id]:
            raise SpanPromptError(f"{where} is a pre-built span: EPIC splits documents "
                                  "itself, pass the document body instead")
        head, span = epic_document(body, recompute_blocks, protocol, block_size, where)
        parts.append(head + (span or []))
        spans += [span] if span else []
    header = _header(system, tokenizer, protocol, block_size)
    return _assemble(header, parts, spans, task, tokenizer, protocol, block_size)
