"""A minipic server's own settings, read from GET /v1/minipic/settings (client process).

Client tools build span prompts with the server's KV block size and markers; a
wrong block size makes every span miss while each prefill still "succeeds", and
a server without minipic stores no span at all. So the tools ask the server and
stop when it does not answer as a minipic server (a stock vLLM, or minipic off).
An explicit block size or span protocol is only an override that must agree.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from minipic.config import DEFAULT_SERVER_RECIPE
from minipic.protocol import SpanProtocol
from minipic.serving.settings_route import SETTINGS_PATH  # the server's route, one spelling


class NotAMinipicServerError(RuntimeError):
    """The server does not run minipic: spans sent there would never be stored."""


class SettingsDisagreeError(ValueError):
    """A block size or span protocol given by the user differs from the server's."""


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    block_size: int
    protocol: SpanProtocol
    max_model_len: int | None
    recipe: str

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ServerSettings":
        return cls(block_size=int(data["block_size"]),
                   protocol=SpanProtocol.from_dict(data["span_protocol"]),
                   max_model_len=data.get("max_model_len"),
                   recipe=data.get("recipe", DEFAULT_SERVER_RECIPE))

    def check_overrides(self, block_size: int | None, protocol: SpanProtocol | None) -> None:
        if block_size is not None and block_size != self.block_size:
            raise SettingsDisagreeError(
                f"block size {block_size} was given, but the server runs with KV blocks of "
                f"{self.block_size} tokens: spans padded to {block_size} would never hit "
                f"(leave the block size out; minipic reads it from the server)")
        if protocol is not None and protocol != self.protocol:
            raise SettingsDisagreeError(
                f"span protocol {protocol.to_dict()} was given, but the server's is "
                f"{self.protocol.to_dict()} (leave it out; minipic reads it from the server)")


async def fetch_server_settings(url: str, api_key: str | None,
                                timeout_s: float = 30.0) -> ServerSettings:
    """The settings of the minipic server at `url` (with or without /v1)."""
    import httpx

    root = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as http:
            response = await http.get(f"{root}{SETTINGS_PATH}", headers=headers)
    except httpx.HTTPError as e:  # an OSError, so callers report it as "could not run"
        raise ConnectionError(f"cannot reach the server at {url}: {type(e).__name__}: {e}") \
            from None
    if response.status_code == 404:
        raise NotAMinipicServerError(
            f"the server at {url} does not run minipic (GET {SETTINGS_PATH}: 404): it would "
            "store no span. Start it with --additional-config '{\"minipic\": {}}' or "
            "minipic's connector (vLLM 0.25.1 servers have no settings route: pass the block "
            "size and trust_server=True / --trust-server)")
    if response.status_code != 200:
        raise RuntimeError(f"GET {root}{SETTINGS_PATH} answered {response.status_code}: "
                           f"{response.text[:200]}")
    return ServerSettings.from_json(response.json())
