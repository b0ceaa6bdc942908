"""What every position-free backend supports, declared once for vLLM's backend checks.

Causal decoder self-attention only: span frames and the span layout assume key j of a
request sits at position j (or its logical position) and that queries see keys
before them. Windows, sinks, bidirectional ranges and ALiBi would each need their own
position handling.
"""

from __future__ import annotations

from vllm.v1.attention.backend import AttentionType


class UnsupportedAttentionError(NotImplementedError):
    """A layer feature minipic's position-free attention does not implement (both backends)."""


class PositionFreeTraits:
    """Mixed in first, before the vLLM backend class it refines."""

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_rswa(cls) -> bool:
        return False

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    def supports_alibi_sqrt(cls) -> bool:
        return False
