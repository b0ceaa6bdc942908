"""Worker side: the model's rotary embedding, as the rotation parameters attention needs.

The model's RoPE runs as in stock vLLM (Q and K rotated at their index). minipic's
attention then moves keys between frames (span_layout.SpanLayout.frame_offset) and
queries to their logical positions, with the same rotation: every rotary embedding
the model builds is registered here (`current_rope()`), as an fp32 cos/sin table so
that math is fp32 whatever the model dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


class UnsupportedRopeError(RuntimeError):
    """The model's positional encoding cannot be moved into attention."""


@dataclasses.dataclass
class RopeParams:
    """Everything position-free attention needs to rotate queries and keys."""

    head_size: int
    rotary_dim: int
    is_neox_style: bool
    cos_sin_fp32: torch.Tensor  # [max_positions, rotary_dim] = cat(cos, sin)

    def cos_sin(self, device: torch.device) -> torch.Tensor:
        # Moved once per device and kept: a static buffer, safe for CUDA graphs.
        if self.cos_sin_fp32.device != device:
            self.cos_sin_fp32 = self.cos_sin_fp32.to(device)
        return self.cos_sin_fp32

    def same_rotation(self, other: "RopeParams") -> bool:
        return (
            (self.head_size, self.rotary_dim, self.is_neox_style)
            == (other.head_size, other.rotary_dim, other.is_neox_style)
            and self.cos_sin_fp32.shape == other.cos_sin_fp32.shape
            and torch.equal(self.cos_sin_fp32, other.cos_sin_fp32.to(self.cos_sin_fp32.device))
        )


_current: RopeParams | None = None


def current_rope() -> RopeParams:
    if _current is None:
        raise UnsupportedRopeError(
            "minipic's attention found no rotary embedding in this model: "
            "position-free KV needs a RoPE model (Llama family)"
        )
    return _current


def head_mismatch(rope: RopeParams, head_size: int) -> str | None:
    """Why attention over heads of `head_size` cannot rotate keys with `rope`, if it cannot."""
    if rope.head_size == head_size:
        return None
    return (f"the rotary embedding covers {rope.head_size} of each head's {head_size} dims "
            "(e.g. a decoupled RoPE part, as in MiniCPM3): minipic rotates whole heads only")


def reset_rope() -> None:
    """Forget the registered rope (a new model is being built in this process)."""
    global _current
    _current = None


def register_rope(rope: Any) -> None:
    """Register one vLLM rotary embedding instance (refused if attention cannot redo it)."""
    _refuse_unsupported(rope)
    params = RopeParams(
        head_size=rope.head_size,
        rotary_dim=rope.rotary_dim,
        is_neox_style=rope.is_neox_style,
        # Recomputed in fp32: the module's buffer may already be cast to bf16.
        cos_sin_fp32=rope._compute_cos_sin_cache().to(torch.float32),
    )
    _register(params)


def _register(params: RopeParams) -> None:
    global _current
    if _current is None:
        _current = params
    elif not _current.same_rotation(params):
        raise UnsupportedRopeError(
            "this model uses more than one rotary embedding (e.g. local and global "
            "layers with different bases): minipic supports one RoPE per model"
        )


def _refuse_unsupported(rope: Any) -> None:
    # Only rotations fully described by `cos_sin_cache` and the standard
    # neox/GPT-J formula can be redone in attention: any subclass that overrides
    # the forward math (MRoPE, Phi-3 long/short, dual-chunk, ...) is refused.
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    cls = type(rope)
    overridden = [
        name
        for name in ("forward_native", "forward_cuda", "forward_cpu", "forward_static")
        if getattr(cls, name, None) is not getattr(RotaryEmbedding, name)
    ]
    # Several linear scaling factors offset Q positions per request (long-context LoRA).
    if len(getattr(rope, "scaling_factors", None) or ()) > 1:
        overridden.append("several scaling factors with per-request position offsets")
    if not isinstance(rope, RotaryEmbedding) or overridden:
        raise UnsupportedRopeError(
            f"minipic cannot use this model's rotary embedding {cls.__name__}: it "
            f"computes positions its own way ({', '.join(overridden) or 'not a RotaryEmbedding'}), "
            "so attention cannot move keys between frames or queries to logical positions"
        )
