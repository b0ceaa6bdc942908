"""RAG recipes: Block-Attention and EPIC prompts from documents and a task.

Both lay the final prompt out as
    [BOS + system + pad] [SSep document 0] [SSep document 1] ... [PDep + task]
and EPIC adds a link segment per document before the task (see `epic`). The header (when there is a
BOS or a system prompt) is chained normally from block 0 and is a prefill
request of its own, so it hits too; the task is never padded (generation
follows it) and never hits (PDep).
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

from minipic.client.prompts.span_prompt import (
    SpanPrompt, SpanPromptError, TextOrTokens, bos_of, check_block_size, make_header,
    make_task, span_from, to_tokens,
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


def epic_link(span: Sequence[int], recompute_blocks: int, protocol: SpanProtocol,
              block_size: int) -> list[int]:
    """The link segment of one span: its first `recompute_blocks` blocks (all of them
    when it is shorter), with the link marker in place of SSep.

    In the final prompt the engine computes it in context, at the span's own
    logical positions, and every later query sees it instead of the span's solo
    head (minipic.attention.span_layout). Its hash is a PDep hash: its KV depends on
    everything before it, so it only hits after the same header and documents.
    """
    if protocol.link_token_id is None:
        raise SpanPromptError(
            "EPIC needs a link marker: the span protocol has no link_token_id (set it in "
            "minipic's config next to ssep_token_id, or let minipic pick reserved tokens)")
    check_block_size(block_size)
    _check_recompute_blocks(recompute_blocks)
    head = list(span[: recompute_blocks * block_size])
    return [protocol.link_token_id, *head[1:]] if head else []


def recomputed_blocks(recompute_blocks: Any, recompute_tokens: Any, block_size: int) -> int:
    """The link blocks per document EPIC recomputes: `recompute_blocks`, or the blocks
    that hold `recompute_tokens`, or 1; giving both is refused (which would win?)."""
    refuse_both_amounts(recompute_blocks, recompute_tokens)
    if recompute_tokens is not None:
        return blocks_for_tokens(recompute_tokens, block_size)
    return 1 if recompute_blocks is None else recompute_blocks


def refuse_both_amounts(recompute_blocks: Any, recompute_tokens: Any) -> None:
    if recompute_blocks is not None and recompute_tokens is not None:
        raise SpanPromptError(
            f"give recompute_blocks ({recompute_blocks!r}) or recompute_tokens "
            f"({recompute_tokens!r}), not both")


def blocks_for_tokens(recompute_tokens: Any, block_size: int) -> int:
    """The whole blocks that hold at least `recompute_tokens` tokens."""
    if isinstance(recompute_tokens, bool) or not isinstance(recompute_tokens, int) \
            or recompute_tokens < 0:
        raise SpanPromptError(f"recompute_tokens must be an int >= 0, got {recompute_tokens!r}")
    return -(-recompute_tokens // block_size)


def _check_recompute_blocks(recompute_blocks: Any) -> None:
    if isinstance(recompute_blocks, bool) or not isinstance(recompute_blocks, int) \
            or recompute_blocks < 0:
        raise SpanPromptError(f"recompute_blocks must be an int >= 0, got {recompute_blocks!r}")


def epic(docs: Sequence[TextOrTokens], task: TextOrTokens, *, protocol: SpanProtocol,
         block_size: int, recompute_blocks: int | None = None,
         system: TextOrTokens | None = None, tokenizer: Any = None,
         recompute_tokens: int | None = None) -> SpanPrompt:
    """[BOS + system + pad] [SSep d0 pad] ... [SSep dN pad] [link d0] ... [link dN] [PDep task].

    EPIC (LegoLink) for models not fine-tuned for block attention: every document
    is a span prefilled alone, as in Block-Attention, and hits at any offset; the
    first `recompute_blocks` blocks of each are then recomputed in context by its
    link segment, which every later query sees in place of the solo head. The
    links sit after all spans, so the whole header-and-spans prefix is one
    contiguous vLLM hit; only links and task are computed.
    `recompute_tokens` (instead of blocks): at least that many tokens of each document,
    in whole blocks, so a recipe keeps its accuracy at every block size. Neither given:
    one block (EPIC's own choice); both: refused.
    """
    block_size = check_block_size(block_size)
    recompute_blocks = recomputed_blocks(recompute_blocks, recompute_tokens, block_size)
    _check_recompute_blocks(recompute_blocks)
    spans = [span_from(doc, protocol, block_size, tokenizer, f"document {i}")
             for i, doc in enumerate(_check_docs(docs))]
    links = [epic_link(span, recompute_blocks, protocol, block_size) for span in spans]
    header = _header(system, tokenizer, protocol, block_size)
    return _assemble(header, spans + links, spans, task, tokenizer, protocol, block_size)


# The tokens of each document EPIC recomputes by default: on SmolLM2-135M one 32-token block
# stayed 10 points below full prefill, 64 tokens within 3.6 (docs/accuracy.md). Counted in
# tokens, not blocks: at vLLM's 16-token GPU blocks two blocks would be 32 tokens again.
ACCURATE_RECOMPUTE_TOKENS = 64

# The recipes a name selects: the server's `recipe` option and per-request override
# (config.SERVER_RECIPES lists the same names), and tools/bench_accuracy.py's methods.
# epic64, the default, recomputes each document's first 64 tokens (2 blocks of 32, 4 of
# 16); epic and epic2 one and two blocks, whatever their size.
RECIPES_BY_NAME = {"epic64": functools.partial(epic, recompute_tokens=ACCURATE_RECOMPUTE_TOKENS),
                   "epic": epic, "epic2": functools.partial(epic, recompute_blocks=2),
                   "block_attention": block_attention}
