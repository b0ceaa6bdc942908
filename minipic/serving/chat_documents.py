"""Chat requests with `documents`, rendered as span prompts (API server process).

vLLM's chat API takes a `documents` list (dicts with "text" and an optional
"title") and hands it to the chat template. With minipic on, the server lays it
out as a span prompt instead, so a plain OpenAI client gets document reuse
without knowing KV blocks, markers or the block size:

    [header: the leading system turns] [SSep doc 0] [SSep doc 1] ... [links] [PDep: the rest]

The header and the rest are vLLM's own rendering of the conversation without the
documents (chat template, tools, generation prompt, cache_salt all as usual);
the header is the rendering of the leading system messages alone, which must be
a token prefix of the whole. Each document is cut into spans exactly as
`minipic-preload` and `RagClient` cut it (client/prompts/document_spans.py: windows of
DEFAULT_SPAN_TOKENS, each padded to the engine's block size), so what a preload
stored is what a chat request hits; the recipe (EPIC, links after all spans: `epic64`
by default, each document's first 64 tokens recomputed in whole blocks; `epic2` or
`epic`, two or one recomputed blocks; or `block_attention`) comes from minipic's
`recipe` option or, per request, from `vllm_xargs: {"minipic_recipe": ...}`. The builders
are minipic.client's, so a client building the same prompt from the same token ids gets
the same tokens.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Mapping, Sequence

from minipic.client import SpanPrompt, SpanPromptError
from minipic.client.prompts.document_spans import document_spans
from minipic.client.prompts.recipes import RECIPES_BY_NAME
from minipic.client.prompts.span_prompt import check_body, to_tokens
from minipic.config import check_recipe
from minipic.protocol import SpanProtocol
from minipic.request_errors import MinipicRequestError

RECIPE_XARG = "minipic_recipe"
DOCUMENT_KEYS = ("title", "text")


class DocumentsRequestError(MinipicRequestError):
    """A chat request whose `documents` minipic cannot lay out as spans (HTTP 400)."""


def document_texts(documents: Any) -> list[str]:
    """Each document's text ("title" line first when given); refuses what would be lost."""
    if not isinstance(documents, Sequence) or isinstance(documents, str) or not documents:
        raise DocumentsRequestError("documents must be a non-empty list of "
                                    '{"text": ..., "title": ...} objects')
    return [_document_text(doc, f"documents[{i}]") for i, doc in enumerate(documents)]


def _document_text(doc: Any, where: str) -> str:
    if not isinstance(doc, Mapping):
        raise DocumentsRequestError(f'{where} must be an object with a "text" string')
    unknown = sorted(set(doc) - set(DOCUMENT_KEYS))
    if unknown:
        raise DocumentsRequestError(f"{where} has unknown key(s) {', '.join(map(repr, unknown))};"
                                    f" minipic reads {' and '.join(map(repr, DOCUMENT_KEYS))}")
    text, title = doc.get("text"), doc.get("title")
    if not isinstance(text, str) or not text.strip():
        raise DocumentsRequestError(f'{where} has no text: "text" must be a non-empty string')
    if title is not None and not isinstance(title, str):
        raise DocumentsRequestError(f'{where}: "title" must be a string')
    return f"{title}\n{text}" if title else text


def request_recipe(vllm_xargs: Mapping[str, Any] | None, server_default: str) -> str:
    """The request's `vllm_xargs.minipic_recipe`, else the server's option."""
    value = (vllm_xargs or {}).get(RECIPE_XARG, server_default)
    try:
        return check_recipe(value, f"vllm_xargs.{RECIPE_XARG}")
    except ValueError as e:
        raise DocumentsRequestError(str(e)) from None


def build_span_prompt(header: Sequence[int], whole: Sequence[int], texts: Sequence[str], *,
                      tokenizer: Any, protocol: SpanProtocol, block_size: int,
                      recipe: str) -> SpanPrompt:
    """The span prompt for a prompt vLLM rendered as `whole` whose first tokens, `header`,
    come before the documents (for chat: the leading system messages rendered alone)."""
    header, whole = list(header), list(whole)
    if whole[:len(header)] != header:
        raise DocumentsRequestError(
            "the chat template renders the system messages differently on their own than at "
            "the start of the conversation, so minipic cannot place documents after them")
    task = whole[len(header):]
    builder = RECIPES_BY_NAME[recipe]
    # Token ids, not text, and no tokenizer: vLLM's rendering already chose the BOS.
    try:
        spans = [span for i, text in enumerate(texts)
                 for span in document_spans(
                     _document_tokens(text, tokenizer, protocol, f"documents[{i}]"),
                     protocol=protocol, block_size=block_size, where=f"documents[{i}]")]
        return builder(spans, task, system=header or None, protocol=protocol,
                       block_size=block_size)
    except SpanPromptError as e:
        raise DocumentsRequestError(str(e)) from None


def _document_tokens(text: str, tokenizer: Any, protocol: SpanProtocol, where: str) -> list[int]:
    tokens = to_tokens(text, tokenizer, where)
    if not tokens:
        raise DocumentsRequestError(f"{where} has no tokens")
    try:
        check_body(tokens, protocol, where)  # text that spells a marker's special token
    except SpanPromptError as e:
        raise DocumentsRequestError(str(e)) from None
    return tokens


def check_fits(prompt: SpanPrompt, max_model_len: int, documents: int) -> None:
    """Padding makes the span prompt longer than the plain one: say so before the engine does."""
    if len(prompt.final) >= max_model_len:
        raise DocumentsRequestError(
            f"the span prompt for {documents} document(s) has {len(prompt.final)} tokens "
            f"(each document padded to whole KV blocks), which leaves no room to generate "
            f"within max_model_len {max_model_len}: send fewer or shorter documents")


Render = Callable[[Any], Awaitable[Any]]


async def render_chat_with_documents(request: Any, render: Render, *, tokenizer: Any,
                                     protocol: SpanProtocol, block_size: int,
                                     max_model_len: int, server_recipe: str) -> Any:
    """(conversation, [engine input]) for a chat request with documents, or what `render`
    returned when it refused the request (vLLM's error response).

    `render` is vLLM's own chat rendering of a request (the original hook); it runs
    twice, both times with `documents` removed so no template sees them.
    """
    texts = document_texts(request.documents)
    recipe = request_recipe(request.vllm_xargs, server_recipe)
    system_only = _system_only(request)
    # The request itself, not a copy: vLLM's parsers adjust it while rendering and later
    # read it back (sampling, tools). No template may see the documents.
    request.documents = None
    whole = await render(request)
    if not isinstance(whole, tuple):
        return whole  # vLLM's own refusal (bad model name, tool choice, template, ...)
    conversation, engine_inputs = whole
    engine_input = single_token_input_of(engine_inputs)
    header: Sequence[int] = []
    if system_only.messages:
        rendered = await render(system_only)
        if not isinstance(rendered, tuple):
            return rendered
        header = single_token_input_of(rendered[1])["prompt_token_ids"]
    prompt = build_span_prompt(
        header, engine_input["prompt_token_ids"], texts, tokenizer=tokenizer,
        protocol=protocol, block_size=block_size, recipe=recipe)
    check_fits(prompt, max_model_len, len(texts))
    return conversation, [with_tokens(engine_input, prompt.final)]


def with_tokens(engine_input: Mapping[str, Any], token_ids: list[int]) -> dict[str, Any]:
    """The same engine input (cache_salt, arrival time) with the span prompt's tokens; the
    text of the plain rendering would no longer match them, so it goes."""
    span_input = {k: v for k, v in engine_input.items()
                  if k not in ("prompt", "prompt_token_offsets")}
    span_input["prompt_token_ids"] = token_ids
    return span_input


def _system_only(request: Any) -> Any:
    """A copy of the request cut to its leading system messages, with no generation prompt."""
    messages = list(request.messages)
    leading = 0
    while leading < len(messages) and _role(messages[leading]) in ("system", "developer"):
        leading += 1
    return request.model_copy(update={"documents": None, "messages": messages[:leading],
                                      "add_generation_prompt": False,
                                      "continue_final_message": False})


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, Mapping) else getattr(message, "role", None)


def single_token_input_of(engine_inputs: Sequence[Any]) -> Mapping[str, Any]:
    if len(engine_inputs) != 1 or engine_inputs[0].get("type", "token") != "token" \
            or "prompt_token_ids" not in engine_inputs[0]:
        raise DocumentsRequestError("minipic lays out documents for text-only requests; "
                                    "this one has multimodal or embedding inputs")
    return engine_inputs[0]
