"""Worker side (CUDA): the two small Triton kernels around a span batch's FlashAttention rows.

Per layer a span batch on FlashAttention runs four launches: `turn_rows` (every row's
queries gathered and turned back into the frame they read, one launch for both
calls), the causal and the non-causal FlashAttention call (one call for a decode
batch), and `merge_rows` (each query token's rows merged by their log-sum-exp). The
same turn kernel turns new keys into their frames before the cache write. In torch
the turns and the merge take some thirty small launches a layer, which cost more
than the attention itself on a short task after a hit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _turn_rows_kernel(q_ptr, index_ptr, cos_ptr, sin_ptr, out_ptr,
                      q_stride_t, q_stride_h, out_stride_t, out_stride_h, turn_stride,
                      HEADS: tl.constexpr, HEADS_PADDED: tl.constexpr,
                      HEAD_SIZE: tl.constexpr, ROT_HALF: tl.constexpr,
                      HALF_PADDED: tl.constexpr, PASS_PADDED: tl.constexpr,
                      IS_NEOX: tl.constexpr, HAS_INDEX: tl.constexpr):
    # One program per row, all heads at once: a program per (row, head) moved 256 bytes
    # and its launch grid, not the memory, set the kernel's time.
    # int64 offsets: rows x row stride passes 2^31 elements on long batches
    row = tl.program_id(0).to(tl.int64)
    if HAS_INDEX:
        token = tl.load(index_ptr + row).to(tl.int64)
    else:  # row i turns token i
        token = row
    head = tl.arange(0, HEADS_PADDED)[:, None]
    head_mask = head < HEADS
    src = q_ptr + token * q_stride_t + head * q_stride_h
    dst = out_ptr + row * out_stride_t + head * out_stride_h
    r = tl.arange(0, HALF_PADDED)[None, :]
    r_mask = r < ROT_HALF
    if IS_NEOX:  # the two halves of the rotary dims are the (real, imag) pairs
        first, second = r, r + ROT_HALF
    else:  # GPT-J: even and odd dims
        first, second = 2 * r, 2 * r + 1
    mask = head_mask & r_mask
    x1 = tl.load(src + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + second, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + row * turn_stride + r, mask=r_mask, other=1.0)
    sin = tl.load(sin_ptr + row * turn_stride + r, mask=r_mask, other=0.0)
    tl.store(dst + first, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + second, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    p = 2 * ROT_HALF + tl.arange(0, PASS_PADDED)[None, :]  # dims past rotary_dim pass
    p_mask = head_mask & (p < HEAD_SIZE)
    tl.store(dst + p, tl.load(src + p, mask=p_mask, other=0.0), mask=p_mask)


def turn_rows(query: torch.Tensor, index: torch.Tensor | None, cos: torch.Tensor,
              sin: torch.Tensor, rotary_dim: int, is_neox_style: bool) -> torch.Tensor:
    """[rows, heads, head_size]: query[index[i]] turned by (cos[i], sin[i]) (a
    rotation.Rotation's tables), in the query's dtype; index None: query[i], for the
    first cos.shape[0] tokens (the K turn before the cache write)."""
    rows, (_, heads, head_size) = cos.shape[0], query.shape
    assert query.stride(-1) == 1, "the kernel reads each head's dims as one run"
    out = torch.empty(rows, heads, head_size, dtype=query.dtype, device=query.device)
    if rows == 0:
        return out
    half = rotary_dim // 2
    cos, sin = cos.contiguous(), sin.contiguous()
    # Without an index the kernel never reads index_ptr: any pointer stands in for it.
    _turn_rows_kernel[(rows,)](
        query, cos if index is None else index, cos, sin, out, query.stride(0),
        query.stride(1), out.stride(0), out.stride(1), cos.stride(0), HEADS=heads,
        HEADS_PADDED=triton.next_power_of_2(heads), HEAD_SIZE=head_size,
        ROT_HALF=half, HALF_PADDED=triton.next_power_of_2(half),
        PASS_PADDED=triton.next_power_of_2(max(head_size - rotary_dim, 1)),
        IS_NEOX=is_neox_style, HAS_INDEX=index is not None)
    return out


@triton.jit
def _merge_rows_kernel(own_ptr, own_lse_ptr, earlier_ptr, earlier_lse_ptr, starts_ptr,
                       entries_ptr, out_ptr, own_stride_t, own_stride_h, own_lse_stride_h,
                       earlier_stride_t, earlier_stride_h, earlier_lse_stride_h,
                       out_stride_t, out_stride_h, HEADS: tl.constexpr,
                       HEADS_PADDED: tl.constexpr, HEAD_SIZE: tl.constexpr,
                       HEAD_PADDED: tl.constexpr):
    # One program per token, all heads at once (as in _turn_rows_kernel); int64 offsets.
    token = tl.program_id(0).to(tl.int64)
    first = tl.load(starts_ptr + token)
    last = tl.load(starts_ptr + token + 1)
    head = tl.arange(0, HEADS_PADDED)
    head_mask = head < HEADS
    own_lse = tl.load(own_lse_ptr + head * own_lse_stride_h + token, mask=head_mask, other=0.0)
    peak = own_lse
    for i in range(first, last):
        entry = tl.load(entries_ptr + i).to(tl.int64)
        peak = tl.maximum(peak, tl.load(earlier_lse_ptr + head * earlier_lse_stride_h + entry,
                                        mask=head_mask, other=0.0))
    d = tl.arange(0, HEAD_PADDED)[None, :]
    mask = head_mask[:, None] & (d < HEAD_SIZE)
    weight = tl.exp(own_lse - peak)
    total = weight[:, None] * tl.load(
        own_ptr + token * own_stride_t + head[:, None] * own_stride_h + d,
        mask=mask, other=0.0).to(tl.float32)
    norm = weight
    for i in range(first, last):
        entry = tl.load(entries_ptr + i).to(tl.int64)
        w = tl.exp(tl.load(earlier_lse_ptr + head * earlier_lse_stride_h + entry,
                           mask=head_mask, other=0.0) - peak)
        total += w[:, None] * tl.load(
            earlier_ptr + entry * earlier_stride_t + head[:, None] * earlier_stride_h + d,
            mask=mask, other=0.0).to(tl.float32)
        norm += w
    tl.store(out_ptr + token * out_stride_t + head[:, None] * out_stride_h + d,
             (total / norm[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


def merge_rows(output: torch.Tensor, own_out: torch.Tensor, own_lse: torch.Tensor,
               earlier_out: torch.Tensor, earlier_lse: torch.Tensor, starts: torch.Tensor,
               entries: torch.Tensor) -> torch.Tensor:
    """output [n, heads, d]: each token's own row merged with its earlier rows
    entries[starts[t]:starts[t + 1]] (segment_plan.SegmentPlan.merge_starts), by LSE."""
    n, heads, head_size = output.shape
    own_lse, earlier_lse = own_lse.float(), earlier_lse.float()
    assert own_lse.stride(1) == 1 and earlier_lse.stride(1) == 1
    _merge_rows_kernel[(n,)](
        own_out, own_lse, earlier_out, earlier_lse, starts, entries, output,
        own_out.stride(0), own_out.stride(1), own_lse.stride(0), earlier_out.stride(0),
        earlier_out.stride(1), earlier_lse.stride(0), output.stride(0), output.stride(1),
        HEADS=heads, HEADS_PADDED=triton.next_power_of_2(heads), HEAD_SIZE=head_size,
        HEAD_PADDED=triton.next_power_of_2(head_size))
    return output
