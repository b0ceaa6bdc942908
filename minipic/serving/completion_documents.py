"""Completions with documents, as span prompts (API server process).

The completions API has no `documents` field, and vLLM's convention for what a
plugin adds to a request is `vllm_xargs` ("used by custom extensions"), which
takes lists of strings. So:

    vllm_xargs: {"minipic_documents": ["text 1", "text 2"],   # required
                 "minipic_system": "instructions",             # optional header text
                 "minipic_recipe": "block_attention"}          # optional, as for chat

turns each prompt into  [BOS + system] [SSep doc 0] ... [links] [PDep prompt], the
BOS being the one vLLM's own tokenization put at the start of the prompt. The
three keys are taken out of `vllm_xargs` before sampling: the documents need not
travel to the engine core again as sampling arguments.
"""

from __future__ import annotations

from typing import Any

from minipic.serving.chat_documents import (
    RECIPE_XARG, DocumentsRequestError, Render, build_span_prompt, check_fits,
    request_recipe, single_token_input_of, with_tokens,
)
from minipic.client.prompts.span_prompt import SpanPromptError, to_tokens
from minipic.protocol import SpanProtocol

DOCUMENTS_XARG = "minipic_documents"
SYSTEM_XARG = "minipic_system"


def wants_documents(request: Any) -> bool:
    return DOCUMENTS_XARG in (getattr(request, "vllm_xargs", None) or {})


def document_strings(documents: Any) -> list[str]:
    if not isinstance(documents, list) or not documents:
        raise DocumentsRequestError(f"vllm_xargs.{DOCUMENTS_XARG} must be a non-empty list "
                                    "of document texts")
    for i, text in enumerate(documents):
        if not isinstance(text, str) or not text.strip():
            raise DocumentsRequestError(f"vllm_xargs.{DOCUMENTS_XARG}[{i}] must be non-empty "
                                        f"text, got {text!r}")
    return documents


async def render_completion_with_documents(request: Any, render: Render, *, tokenizer: Any,
                                           protocol: SpanProtocol, block_size: int,
                                           max_model_len: int, server_recipe: str) -> Any:
    """vLLM's engine inputs for the request, each laid out around the documents."""
    xargs = dict(request.vllm_xargs)
    texts = document_strings(xargs.pop(DOCUMENTS_XARG))
    system = _system_tokens(xargs.pop(SYSTEM_XARG, None), tokenizer)
    recipe = request_recipe(xargs, server_recipe)
    xargs.pop(RECIPE_XARG, None)
    request.vllm_xargs = xargs or None
    engine_inputs = await render(request)
    if not isinstance(engine_inputs, list):
        return engine_inputs  # vLLM's own refusal
    laid_out = []
    for engine_input in engine_inputs:
        ids = list(single_token_input_of([engine_input])["prompt_token_ids"])
        bos = getattr(tokenizer, "bos_token_id", None)
        lead = ids[:1] if bos is not None and ids[:1] == [bos] else []
        header = lead + system
        prompt = build_span_prompt(header, header + ids[len(lead):], texts, tokenizer=tokenizer,
                                   protocol=protocol, block_size=block_size, recipe=recipe)
        check_fits(prompt, max_model_len, len(texts))
        laid_out.append(with_tokens(engine_input, prompt.final))
    return laid_out


def _system_tokens(system: Any, tokenizer: Any) -> list[int]:
    if system is None:
        return []
    if not isinstance(system, str):
        raise DocumentsRequestError(f"vllm_xargs.{SYSTEM_XARG} must be text, got {system!r}")
    try:
        return to_tokens(system, tokenizer, f"vllm_xargs.{SYSTEM_XARG}")
    except SpanPromptError as e:
        raise DocumentsRequestError(str(e)) from None
