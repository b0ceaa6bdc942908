"""RoPE rotations in fp32: keys into and out of their frames, queries to logical positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Rotation:
    """A per-token RoPE rotation: cos and sin [tokens, rotary_dim / 2], fp32.

    Looked up once per batch and applied at every layer: the lookup (a gather, signs,
    scale) is most of a rotation's kernel launches."""

    cos: torch.Tensor
    sin: torch.Tensor
    rotary_dim: int
    is_neox_style: bool

    @classmethod
    def at(cls, positions: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int,
           is_neox_style: bool, backwards: bool = False, pure: bool = False,
           non_negative: bool = False) -> Rotation:
        """RoPE at `positions` [tokens] from `cos_sin` [max_positions, rotary_dim] =
        cat(cos, sin), as in vLLM's `cos_sin_cache`. `backwards` rotates by -positions
        (R(p) is orthogonal: its inverse is R(-p)). `pure` divides out a scale the table
        folds into its rows (see turn_back). `non_negative`: the caller checked on the host
        that no position is negative, so the sign's device ops are left out."""
        if non_negative:
            cos, sin = cos_sin.index_select(0, positions).float().chunk(2, dim=-1)
            if backwards:
                sin = -sin
        else:
            positions = positions.long()
            cos, sin = cos_sin.index_select(0, positions.abs()).float().chunk(2, dim=-1)
            # R(-p) = (cos p, -sin p): a negative position turns the other way (mask_markers
            # reads a span at the prompt's start from one position before it, see
            # span_layout).
            flip = (positions < 0)[:, None]
            if backwards:
                flip = ~flip
            sin = torch.where(flip, -sin, sin)
        if pure:
            scale = cos_sin[0, : cos.shape[-1]].float()  # row 0 is (a, 0): a = 1 without mscale
            cos, sin = cos / scale, sin / scale
        return cls(cos, sin, rotary_dim, is_neox_style)

    @classmethod
    def back(cls, shifts: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int,
             is_neox_style: bool, non_negative: bool = False) -> Rotation:
        """The pure rotation by -shifts (see turn_back), to apply at every layer."""
        return cls.at(shifts, cos_sin, rotary_dim, is_neox_style, backwards=True, pure=True,
                      non_negative=non_negative)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """`x` [tokens, ..., head_size] rotated (fp32); dimensions past rotary_dim pass."""
        shape = (self.cos.shape[0],) + (1,) * (x.dim() - 2) + (self.cos.shape[-1],)
        cos, sin = self.cos.view(shape), self.sin.view(shape)  # broadcast over heads
        x = x.float()
        x_rot, x_pass = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        if self.is_neox_style:
            # neox: the two halves of the rotary dims form the (real, imag) pairs
            x1, x2 = x_rot.chunk(2, dim=-1)
            rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            # GPT-J: even/odd interleaved dims form the pairs
            x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
            rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return torch.cat((rotated, x_pass), dim=-1) if x_pass.shape[-1] else rotated


def rotate(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
           rotary_dim: int, is_neox_style: bool, backwards: bool = False,
           pure: bool = False) -> torch.Tensor:
    """Apply RoPE to `x` [tokens, ..., heads, head_size] at `positions` [tokens] (fp32).
    See Rotation.at for the arguments."""
    return Rotation.at(positions, cos_sin, rotary_dim, is_neox_style, backwards, pure).apply(x)


def turn_back(x: torch.Tensor, shifts: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int,
              is_neox_style: bool) -> torch.Tensor:
    """Rotate `x` [tokens, heads, head_size] by -shifts [tokens] (fp32).

    A pure rotation: a table that folds a scale into its rows (a*cos, a*sin, as YaRN's
    mscale does; row 0 is then (a, 0)) has it divided out, so x keeps its norm."""
    return Rotation.back(shifts, cos_sin, rotary_dim, is_neox_style).apply(x)
