"""Worker side: every attention layer of a minipic model must be position-free.

minipic switches attention through vLLM's backend selector. A layer that picks
its backend itself (some models pass `attn_backend=` to their layers, some
layer kinds import the selector under another name) would keep a stock backend
over keys stored in span frames: wrong output, no error. Checked once the model is built,
from each position-free layer's load hook, over every layer vLLM registered.
"""

from __future__ import annotations

from typing import Any

from minipic.attention.backend_traits import PositionFreeTraits


class NotPositionFreeError(ValueError):
    """A layer of the model does not use minipic's attention."""


def check_every_layer_is_position_free(layers: dict[str, Any]) -> None:
    """`layers`: vLLM's static forward context (layer name -> layer)."""
    # Other registered layers (fused MoE, ...) have no attention backend to check.
    attention = {n: layer for n, layer in layers.items() if hasattr(layer, "attn_backend")}
    stock = [f"{name} ({type(layer).__name__} on {_backend_name(layer)})"
             for name, layer in attention.items() if not _is_position_free(layer)]
    if stock:
        raise NotPositionFreeError(
            "minipic cannot serve this model: these layers chose their own attention "
            "backend, which would read keys minipic stores in span frames as if at "
            "their positions: "
            + ", ".join(stock[:5]) + (f" and {len(stock) - 5} more" if len(stock) > 5 else ""))


def check_current_model() -> None:
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is not None:
        check_every_layer_is_position_free(config.compilation_config.static_forward_context)


def _is_position_free(layer: Any) -> bool:
    backend = layer.attn_backend
    return isinstance(backend, type) and issubclass(backend, PositionFreeTraits)


def _backend_name(layer: Any) -> str:
    return getattr(layer.attn_backend, "__name__", repr(layer.attn_backend))
