"""Client side: build span prompts (markers, padding, prefill requests) for minipic.

    protocol = SpanProtocol.from_tokenizer(tokenizer)
    p = block_attention(docs, task, system=system, protocol=protocol,
                        block_size=16, tokenizer=tokenizer)
    llm.generate(p.vllm_prefills(), SamplingParams(max_tokens=1))  # spans first
    llm.generate(p.vllm_final(), params)     # expect p.expected_cached_tokens hits
"""

from minipic.client.prompts.prompt_cache import PromptCache, Text
from minipic.client.prompts.recipes import block_attention, epic, epic_link
from minipic.client.prompts.span_prompt import (
    SpanPrompt, SpanPromptError, check_block_size, check_span, make_span, make_task,
    pad_to_block, tokens_prompt,
)

__all__ = [
    "PromptCache", "SpanPrompt", "SpanPromptError", "Text", "block_attention",
    "check_block_size", "check_span", "epic", "epic_link", "make_span", "make_task",
    "pad_to_block", "tokens_prompt",
]

# The rest of the client, by concern: prompts/ (building span prompts), preload/ (a
# corpus into the span store; `minipic-preload` is preload/cli.py), rag/ (the RAG
# client and its schedulers), backends/ (the engines they talk to).
from minipic.client.rag.barrier import BatchedScheduler  # noqa: E402
from minipic.client.rag.isps import InterleavedScheduler  # noqa: E402
from minipic.client.preload.manifest import Manifest  # noqa: E402
from minipic.client.rag.client import DocRef, RagClient  # noqa: E402
from minipic.client.rag.request import RagRequest, RagResult, SpanPrefillFailed  # noqa: E402

__all__ += [
    "BatchedScheduler", "DocRef", "InterleavedScheduler", "Manifest", "RagClient", "RagRequest",
    "RagResult", "SpanPrefillFailed",
]
