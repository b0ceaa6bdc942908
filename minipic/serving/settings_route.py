"""GET /v1/minipic/settings: what a client needs to build span prompts (API server process).

Client tools (minipic-preload, RagClient's OpenAIServerBackend) read the
server's KV block size, span protocol and recipe from here instead of asking
the user: a wrong block size makes every span miss while each prefill still
"succeeds". A stock vLLM server has no such route (404) and a server with
minipic installed but off answers 404 too, so a client tool can tell that
spans would never be stored and stop. The path starts with /v1 so that vLLM's
--api-key guards it like every OpenAI route (its middleware guards /v1 paths only).
"""

# No `from __future__ import annotations`: FastAPI reads the handler's annotations to
# pass the Request, and a string "Request" would not resolve from this module.
from typing import Any, Optional

SETTINGS_PATH = "/v1/minipic/settings"


def server_settings(vllm_config: Any) -> Optional[dict]:
    """The settings of a minipic server, or None when minipic is off for it."""
    from minipic import __version__
    from minipic.config import is_enabled, server_recipe, span_protocol_of

    if vllm_config is None or not is_enabled(vllm_config):
        return None
    import vllm

    return {"minipic_version": __version__, "vllm_version": vllm.__version__,
            "block_size": vllm_config.cache_config.block_size,
            "max_model_len": vllm_config.model_config.max_model_len,
            "span_protocol": span_protocol_of(vllm_config).to_dict(),
            "recipe": server_recipe(vllm_config)}


def attach_settings_route(app: Any) -> None:
    """Add the route to vLLM's FastAPI app (it reads the config when asked)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    async def minipic_settings(request: Request) -> JSONResponse:
        settings = server_settings(getattr(request.app.state, "vllm_config", None))
        if settings is None:
            return JSONResponse({"error": "minipic is not switched on for this server"},
                                status_code=404)
        return JSONResponse(settings)

    app.add_api_route(SETTINGS_PATH, minipic_settings, methods=["GET"])
