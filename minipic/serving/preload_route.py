"""POST /v1/minipic/preload: documents in, their spans prefilled here (API server process).

A client preloading a corpus over HTTP sends text, not token ids: the server
cuts each document into spans with its own tokenizer, KV block size, span
protocol and the same cutting as chat `documents` (client/prompts/document_spans.py),
prefills every distinct span through its engine (one probe token each, as
client/span_prefill.py does in process: a stored span costs one token), and
answers with what the client's manifest records. The client needs no tokenizer
and cannot pick a wrong block size. Request body: serving/preload_request.py.
Answer (200):

    {"block_size": 32, "span_tokens": 512, "span_protocol": {...},
     "documents": [{"num_tokens": 576, "cached_tokens": 0,
                    "spans": [{"span_key": "...", "num_tokens": 512, "token_ids": [...],
                               "status": "new", "cached_tokens": 0, "error": null}, ...]},
                   ...]}

A span's status is "new" (computed now), "stored" (already cached or in the
store: `cached_tokens` covers it), "skipped" (listed in `skip_span_keys`, not
sent to the engine) or "failed" (`error` says why; the others still ran). A
document's `cached_tokens` sums its spans' (null when a span has none). A bad
request is refused whole with HTTP 400 and the reason; a server with minipic
off answers 404, as a stock vLLM does. The path starts with /v1 so that vLLM's
--api-key guards it.
"""

# No `from __future__ import annotations`: FastAPI reads the handler's annotations to
# pass the Request (see settings_route.py).
# minipic.serving.preload_request is imported where used: it imports vLLM, and client
# tools import PRELOAD_PATH from here without loading vLLM.
import asyncio
import json
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from minipic.serving.preload_request import PreloadRequest

PRELOAD_PATH = "/v1/minipic/preload"
NEW, STORED, SKIPPED, FAILED = "new", "stored", "skipped", "failed"


def cut_documents(request: "PreloadRequest", *, tokenizer: Any, protocol: Any,
                  block_size: int) -> list[list[list[int]]]:
    """Each document's spans, as chat `documents` and minipic-preload cut them."""
    from minipic.client.prompts.document_spans import document_spans
    from minipic.client.prompts.span_prompt import SpanPromptError
    from minipic.serving.preload_request import PreloadRequestError

    try:
        return [document_spans(text, protocol=protocol, block_size=block_size,
                               span_tokens=request.span_tokens, tokenizer=tokenizer,
                               where=f"documents[{i}]")
                for i, text in enumerate(request.documents)]
    except SpanPromptError as e:  # e.g. text that spells a marker's special token
        raise PreloadRequestError(f"{e} (a document's text may not spell minipic's marker "
                                  "tokens: remove them)") from None


async def prefill_spans(engine_client: Any, spans: dict[str, list[int]],
                        protocol: Any) -> dict[str, Any]:
    """Each distinct span's SpanPrefill (or the exception it failed with), all at once:
    the engine batches them. The in-process backend's own prefill, on this server's engine."""
    from minipic.client.backends.in_process import AsyncLLMBackend
    from minipic.client.span_prefill import prefill_span

    backend = AsyncLLMBackend(engine_client)  # does not own it: close() is never needed
    outcomes = await asyncio.gather(*(prefill_span(backend, span, protocol)
                                      for span in spans.values()), return_exceptions=True)
    return dict(zip(spans, outcomes))


def span_answer(key: str, span: list[int], outcome: Any) -> dict[str, Any]:
    answer = {"span_key": key, "num_tokens": len(span), "token_ids": span, "status": SKIPPED,
              "cached_tokens": None, "error": None}
    if isinstance(outcome, BaseException):
        answer.update(status=FAILED, error=f"{type(outcome).__name__}: {outcome}")
    elif outcome is not None:
        answer.update(status=STORED if outcome.already_stored else NEW,
                      cached_tokens=outcome.cached_tokens)
    return answer


def document_answer(spans: list[dict[str, Any]]) -> dict[str, Any]:
    cached = [s["cached_tokens"] for s in spans]
    return {"num_tokens": sum(s["num_tokens"] for s in spans),
            "cached_tokens": None if None in cached else sum(cached), "spans": spans}


async def preload(request: "PreloadRequest", engine_client: Any, vllm_config: Any) -> dict:
    """The answer to a checked request: cut, prefill what is not skipped, report."""
    from minipic.client.prompts.document_spans import span_key
    from minipic.config import span_protocol_of

    protocol = span_protocol_of(vllm_config)
    block_size = vllm_config.cache_config.block_size
    documents = cut_documents(request, tokenizer=engine_client.get_tokenizer(),
                              protocol=protocol, block_size=block_size)
    keyed = [[(span_key(span), span) for span in spans] for spans in documents]
    todo = {key: span for spans in keyed for key, span in spans
            if key not in request.skip_span_keys}
    outcomes = await prefill_spans(engine_client, todo, protocol)
    return {"block_size": block_size, "span_tokens": request.span_tokens,
            "span_protocol": protocol.to_dict(),
            "documents": [document_answer([span_answer(key, span, outcomes.get(key))
                                           for key, span in spans]) for spans in keyed]}


def error_body(message: str, code: int) -> dict:
    """vLLM's error shape, which OpenAI clients read the message from."""
    kind = "BadRequestError" if code == 400 else "NotFoundError"
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def attach_preload_route(app: Any) -> None:
    """Add the route to vLLM's FastAPI app (it reads the config when asked)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    from minipic.config import is_enabled
    from minipic.serving.preload_request import PreloadRequestError, parse_preload_request

    async def minipic_preload(request: Request) -> JSONResponse:
        config: Optional[Any] = getattr(request.app.state, "vllm_config", None)
        if config is None or not is_enabled(config):
            return JSONResponse(error_body("minipic is not switched on for this server", 404),
                                status_code=404)
        try:
            checked = parse_preload_request(
                await _json_body(request), block_size=config.cache_config.block_size,
                max_model_len=config.model_config.max_model_len)
            answer = await preload(checked, request.app.state.engine_client, config)
        except PreloadRequestError as e:
            return JSONResponse(error_body(str(e), 400), status_code=400)
        return JSONResponse(answer)

    app.add_api_route(PRELOAD_PATH, minipic_preload, methods=["POST"])


async def _json_body(request: Any) -> Any:
    from minipic.serving.preload_request import PreloadRequestError

    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PreloadRequestError(f"the body is not JSON ({e}); send a JSON object such as "
                                  '{"documents": ["text"]}') from None
