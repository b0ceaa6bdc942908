"""Client side: build span prompts (markers, padding, prefill requests) for minipic.

    protocol = SpanProtocol.from_tokenizer(tokenizer)
    p = block_attention(docs, task, system=system, protocol=protocol,
                        block_size=16, tokenizer=tokenizer)
    llm.generate(p.vllm_prefills(), SamplingParams(max_tokens=1))  # spans first
    llm.generate(p.vllm_final(), params)     # expect p.expected_cached_tokens hits
"""

from minipic.client.prompt_cache import PromptCache, Text
from minipic.client.recipes import block_attention, epic, epic_link
from minipic.client.span_prompt import (
    SpanPrompt, SpanPromptError, check_block_size, check_span, make_span, make_task,
    pad_to_block, tokens_prompt,
)

__all__ = [
    "PromptCache", "SpanPrompt", "SpanPromptError", "Text", "block_attention",
    "check_block_size", "check_span", "epic", "epic_link", "make_span", "make_task",
    "pad_to_block", "tokens_prompt",
]

# Client tools (this package's other modules): RAG client, ISPS and the barrier
# strategy, preload manifest, engine backends. `minipic-preload` is preload.py.
from minipic.client.barrier import BatchedScheduler  # noqa: E402
from minipic.client.isps import InterleavedScheduler  # noqa: E402
from minipic.client.manifest import Manifest  # noqa: E402
from minipic.client.rag_client import DocRef, RagClient  # noqa: E402
from minipic.client.rag_request import RagRequest, RagResult, SpanPrefillFailed  # noqa: E402

__all__ += [
    "BatchedScheduler", "DocRef", "InterleavedScheduler", "Manifest", "RagClient", "RagRequest",
    "RagResult", "SpanPrefillFailed",
]
