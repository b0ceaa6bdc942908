"""Front end: request errors that vLLM answers with HTTP 400 and their message.

vLLM 0.32's AsyncLLM passes `VLLMValidationError` (a `VLLMClientError`) on to
the OpenAI server, which answers 400 with the message; any other exception
raised while a request is processed becomes `EngineGenerateError`, an HTTP 500
with an empty message. Versions without `VLLMValidationError` map `ValueError`
to 400. minipic's request errors are both, so either version names the reason,
and `LLM.generate` callers can keep catching `ValueError`.
"""

from __future__ import annotations

from minipic.protocol import MisplacedMarkerError

try:
    from vllm.exceptions import VLLMValidationError
except ImportError:  # a vLLM from before it: ValueError alone is its 400
    _BASES: tuple[type, ...] = (ValueError,)
else:
    _BASES = (VLLMValidationError, ValueError)


class MinipicRequestError(*_BASES):  # type: ignore[misc]
    """A request minipic refuses; the message says why and how to fix it."""


class MisplacedMarkerRequestError(MinipicRequestError, MisplacedMarkerError):
    """A span marker where it would not act as one (see SpanProtocol.check_marker_placement)."""


class PromptEndsInSpanError(MinipicRequestError):
    """A generation request whose answer would see only the prompt's last SSep span."""
