"""Client side: build span prompts (markers, padding, prefill requests) for minipic.

    protocol = SpanProtocol.from_tokenizer(tokenizer)
    p = block_attention(docs, task, system=system, protocol=protocol,
                        block_size=16, tokenizer=tokenizer)
    llm.generate(p.vllm_prefills(), SamplingParams(max_tokens=1))  # spans first
    llm.generate(p.vllm_final(), params)     # expect p.expected_cached_tokens hits
"""

from minipic.client.prompt_cache import PromptCache, Text
from minipic.client.recipes import block_attention, epic, epic_document
from minipic.client.span_prompt import (
    SpanPrompt, SpanPromptError, check_block_size, check_span, make_span, make_task,
    pad_to_block, tokens_prompt,
)

__all__ = [
    "PromptCache", "SpanPrompt", "SpanPromptError", "Text", "block_attention",
    "check_block_size", "check_span", "epic", "epic_document", "make_span", "make_task",
    "pad_to_block", "tokens_prompt",
]
