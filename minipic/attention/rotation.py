"""RoPE rotations in fp32: keys into and out of their frames, queries to logical positions."""

from __future__ import annotations

import torch


def rotate(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
           rotary_dim: int, is_neox_style: bool, backwards: bool = False,
           pure: bool = False) -> torch.Tensor:
    """Apply RoPE to `x` [tokens, ..., heads, head_size] at `positions` [tokens].

    `cos_sin` is [max_positions, rotary_dim] = cat(cos, sin), as in vLLM's
    `cos_sin_cache`. Dimensions past `rotary_dim` pass through. Returns fp32.
    `backwards` rotates by -positions (R(p) is orthogonal: its inverse is R(-p)).
    `pure` divides out a scale the table folds into its rows (see turn_back).
    """
    x = x.float()
    positions = positions.long()
    cos, sin = cos_sin.index_select(0, positions.abs()).float().chunk(2, dim=-1)
    # R(-p) = (cos p, -sin p): a negative position turns the other way (mask_markers reads
    # a span at the prompt's start from one position before it, see span_layout).
    sin = torch.where((positions < 0)[:, None], -sin, sin)
    if pure:
        scale = cos_sin[0, : cos.shape[-1]].float()  # row 0 is (a, 0): a = 1 without mscale
        cos, sin = cos / scale, sin / scale
    if backwards:
        sin = -sin
    shape = (positions.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)  # broadcast over heads (and batch rows)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    if is_neox_style:
        # neox: the two halves of the rotary dims form the (real, imag) pairs
        x1, x2 = x_rot.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        # GPT-J: even/odd interleaved dims form the pairs
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((rotated, x_pass), dim=-1)


def turn_back(x: torch.Tensor, shifts: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int,
              is_neox_style: bool) -> torch.Tensor:
    """Rotate `x` [tokens, heads, head_size] by -shifts [tokens] (fp32).

    A pure rotation: a table that folds a scale into its rows (a*cos, a*sin, as YaRN's
    mscale does; row 0 is then (a, 0)) has it divided out, so x keeps its norm."""
    return rotate(x, shifts, cos_sin, rotary_dim, is_neox_style, backwards=True, pure=True)
