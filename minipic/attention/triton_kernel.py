"""Position-free paged attention in Triton (paper section 3.2.2).

Q arrives rotated at its position; K sits in vLLM's paged cache rotated in its
frame (span_layout.SpanLayout.frame_offset: a span's keys relative to the span's
start, every other key at its logical position). With span tables, every K tile
is turned forward by its keys' frame offsets in fp32 (cos/sin rows of the
offsets, the table's scale divided out) before the Q.K product, so key j stands
at j (a link key at its logical position). V is untouched; without tables
nothing is rotated: a plain prompt's cache is stock vLLM's. Everything else follows vLLM's
`kernel_unified_attention`: one program per (q-block, kv head), a q-block
holding BLOCK_Q tokens times the kv head's query heads (GQA rows share one K
tile), online softmax over KV tiles, and for small decode batches (and, unlike
vLLM, for a few short queries over long contexts) a split-KV ("3D") variant
whose partial results `_reduce_splits` merges. With span tables (HAS_SPAN_TABLES)
each tile is also masked by minipic's span and EPIC link rule
(span_layout.visible_keys); without them nothing is read and the launch is plain
causal attention.

The rotation never materialises a rotated head: the rotary dims are split into
their two pair halves (neox: first/second half; GPT-J: even/odd dims), each
half is loaded as its own tile, rotated against the other, and Q.K becomes a
sum of dots over the halves plus the pass-through dims (rotary_dim <
head_size). No partner shuffles, no cos/sin duplication.

This module needs only torch and triton (no vLLM), so CPU CI runs it under
`TRITON_INTERPRET=1`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl

from minipic.attention.segment_kernels import launch

_LOG2E = 1.4426950408889634


@triton.jit
def _cdiv(x, y):
    return (x + y - 1) // y


@triton.jit
def _find_seq_idx(query_start_loc_ptr, target, num_seqs,
                  BLOCK_Q: tl.constexpr, IN_Q_BLOCKS: tl.constexpr):
    """Binary search: the request that owns q-block (or token) `target`.

    In q-block units request i starts at `query_start_loc[i] // BLOCK_Q + i`,
    an upper bound that lets the grid be sized without reading query lengths.
    """
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid)
        if IN_Q_BLOCKS:
            start = start // BLOCK_Q + mid
        if start <= target:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _pair_dims(offs_r, ROT_HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    """Head dims of rotary pair r: neox pairs (r, r + half), GPT-J (2r, 2r + 1)."""
    if IS_NEOX:
        return offs_r, offs_r + ROT_HALF
    else:
        return 2 * offs_r, 2 * offs_r + 1


@triton.jit
def _rotate_pair(k1, k2, cos, sin):
    """RoPE on one tile's pair halves, in fp32 (the caller rounds once, to the dot dtype)."""
    k1 = k1.to(tl.float32)
    k2 = k2.to(tl.float32)
    return k1 * cos - k2 * sin, k2 * cos + k1 * sin


@triton.jit
def _load_k_tile(j, kv_end, block_table_row, k_cache_ptr, kv_head, dim_1, dim_2, r_mask,
                 k_stride_0, k_stride_1, k_stride_2, k_stride_3,
                 BLOCK_SIZE: tl.constexpr, TILE_SIZE: tl.constexpr):
    """Tile j's K pair halves, each (ROT_HALF_PADDED, TILE_SIZE); keys >= kv_end read as 0."""
    offs_t = j * TILE_SIZE + tl.arange(0, TILE_SIZE)
    t_mask = offs_t < kv_end
    block = tl.load(block_table_row + offs_t // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
    k_base = (k_cache_ptr + block * k_stride_0 + (offs_t % BLOCK_SIZE).to(tl.int64) * k_stride_1
              + kv_head * k_stride_2)
    kr_mask = r_mask[:, None] & t_mask[None, :]
    k1 = tl.load(k_base[None, :] + dim_1[:, None] * k_stride_3, mask=kr_mask, other=0.0)
    k2 = tl.load(k_base[None, :] + dim_2[:, None] * k_stride_3, mask=kr_mask, other=0.0)
    return k1, k2


@triton.jit
def _frame_cos_sin(frame_offset_ptr, span_row, offs_t, t_mask, cos_sin_ptr, offs_r, r_mask,
                   cos_sin_stride, inv_a, SPAN_BLOCK: tl.constexpr, ROT_HALF: tl.constexpr):
    """cos and sin of the frame offsets of keys `offs_t`, each (ROT_HALF_PADDED, TILE_SIZE)
    fp32, the table's scale divided out (a pure rotation). An offset may be negative
    (mask_markers reads a span at the prompt's start from one before it): R(-p) is
    (cos p, -sin p), so the table's row |p| with sin flipped."""
    offset = tl.load(frame_offset_ptr + span_row + offs_t // SPAN_BLOCK, mask=t_mask, other=0)
    mask = r_mask[:, None] & t_mask[None, :]
    cs = cos_sin_ptr + tl.abs(offset)[None, :].to(tl.int64) * cos_sin_stride + offs_r[:, None]
    sin = tl.load(cs + ROT_HALF, mask=mask, other=0.0) * inv_a[:, None]
    return (tl.load(cs, mask=mask, other=0.0) * inv_a[:, None],
            tl.where((offset < 0)[None, :], -sin, sin))


@triton.jit
def _span_and_context(span_of_ptr, context_pos_ptr, span_row, pos, mask, SPAN_BLOCK: tl.constexpr):
    """Per token at `pos`: its span (-1: none) and its logical position as a query outside
    spans sees it (SpanLayout.context_pos of its block plus its offset in the block)."""
    entry = span_row + pos // SPAN_BLOCK
    span = tl.load(span_of_ptr + entry, mask=mask, other=-1)
    context = tl.load(context_pos_ptr + entry, mask=mask, other=0) + pos % SPAN_BLOCK
    return span, context


@triton.jit
def _span_visible(q_span, q_context, k_span, k_context):
    """span_layout.visible_keys without the causal part, (rows, keys): a query in an SSep span
    sees its own span's keys; any other query sees keys at logical positions up to its own
    (a span head replaced by its link is HIDDEN, past every position)."""
    in_span = q_span[:, None] >= 0
    same_span = k_span[None, :] == q_span[:, None]
    logically_before = k_context[None, :] <= q_context[:, None]
    return tl.where(in_span, same_span, logically_before)


@triton.jit
def _seen_if_quiet(quiet_ptr, seq_idx, quiet_stride, offs_t, t_mask, query_pos, q_span):
    """(rows, keys): False where a key is quiet (a marker or padding, mask_markers) and
    the row is neither its own token's query nor a query in a span (which sees its own
    span's keys only: its marker is the sink it attended to when prefilled alone)."""
    words = tl.load(quiet_ptr + seq_idx.to(tl.int64) * quiet_stride + offs_t // 32,
                    mask=t_mask, other=0)
    quiet = ((words >> (offs_t % 32)) & 1) != 0
    return ~quiet[None, :] | (offs_t[None, :] == query_pos[:, None]) | (q_span[:, None] >= 0)


@triton.jit
def _turned_back(q1, q2, cos_sin_ptr, cos_sin_stride, room, offs_r, r_mask,
                 ROT_HALF: tl.constexpr):
    """The query pairs rotated by -room (fp32 math; the table's row 0 scale divided out)."""
    row = cos_sin_ptr + room.to(tl.int64) * cos_sin_stride + offs_r
    inv_a = 1.0 / tl.load(cos_sin_ptr + offs_r, mask=r_mask, other=1.0)
    cos = (tl.load(row, mask=r_mask, other=1.0) * inv_a)[None, :]
    sin = (tl.load(row + ROT_HALF, mask=r_mask, other=0.0) * inv_a)[None, :]
    a, b = q1.to(tl.float32), q2.to(tl.float32)
    return (a * cos + b * sin).to(q1.dtype), (b * cos - a * sin).to(q1.dtype)


# Sizes that change from batch to batch are not specialized on (Triton specializes an int
# argument, typed or not, on being 1 or a multiple of 16): each new combination would compile
# the kernel again, seconds with every request of the step waiting, and the variants
# compile_short_prefills warms at start-up would not be the ones later batches take.
SIZES_NOT_SPECIALIZED = ["num_seqs", "block_table_stride", "span_table_stride", "quiet_stride"]


@triton.jit(do_not_specialize=SIZES_NOT_SPECIALIZED)
def minipic_attention_kernel(
    out_ptr,  # [tokens, q_heads, head_size]
    q_ptr,  # [tokens, q_heads, head_size], rotated at their positions
    k_cache_ptr,  # [blocks, block_size, kv_heads, head_size], rotated in their frames
    v_cache_ptr,  # [blocks, block_size, kv_heads, head_size]
    cos_sin_ptr,  # [max_positions, rotary_dim] fp32 = cat(cos, sin)
    block_tables_ptr,  # [seqs, max_blocks]
    seq_lens_ptr,  # [seqs]
    query_start_loc_ptr,  # [seqs + 1]
    span_of_ptr,  # HAS_SPAN_TABLES: [seqs, blocks] int32, span_layout.SpanLayout.span_of
    context_pos_ptr,  # HAS_SPAN_TABLES: [seqs, blocks] int32, SpanLayout.context_pos
    frame_offset_ptr,  # HAS_SPAN_TABLES: [seqs, blocks] int32, SpanLayout.frame_offset
    links_end_ptr,  # HAS_SPAN_TABLES: [seqs] int32, SpanLayout.links_end
    link_tokens_ptr,  # HAS_SPAN_TABLES: [seqs] int32, SpanLayout.link_tokens
    quiet_ptr,  # HAS_QUIET: [seqs, words] int32, bit k % 32 of word k // 32: key k is quiet
    split_out_ptr,  # 3D only: [tokens, q_heads, NUM_SPLITS, HEAD_SIZE_PADDED] fp32
    split_max_ptr,  # 3D only: [tokens, q_heads, NUM_SPLITS] fp32
    split_expsum_ptr,  # 3D only: [tokens, q_heads, NUM_SPLITS] fp32
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    num_seqs: tl.int32,
    block_table_stride: tl.int64,
    q_stride_0: tl.int64,
    q_stride_1: tl.int64,
    out_stride_0: tl.int64,
    out_stride_1: tl.int64,
    k_stride_0: tl.int64,
    k_stride_1: tl.int64,
    k_stride_2: tl.int64,
    k_stride_3: tl.constexpr,
    v_stride_0: tl.int64,
    v_stride_1: tl.int64,
    v_stride_2: tl.int64,
    v_stride_3: tl.constexpr,
    cos_sin_stride: tl.int64,
    span_table_stride: tl.int64,  # row stride of the three span tables
    quiet_stride: tl.int64,  # row stride of the quiet bits
    NUM_QUERY_HEADS: tl.constexpr,
    NUM_QUERIES_PER_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    ROT_HALF: tl.constexpr,  # rotary_dim // 2
    ROT_HALF_PADDED: tl.constexpr,
    PASS_SIZE: tl.constexpr,  # head_size - rotary_dim
    PASS_PADDED: tl.constexpr,
    IS_NEOX: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    IS_3D: tl.constexpr,
    PREFETCH: tl.constexpr,
    HAS_SPAN_TABLES: tl.constexpr,  # minipic spans and links (see minipic.attention.span_layout)
    SPAN_BLOCK: tl.constexpr,  # block size the span tables are indexed by
    HAS_QUIET: tl.constexpr,  # mask_markers: marker and padding keys seen in their span only
):
    q_block_global = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2) if IS_3D else 0

    seq_idx = _find_seq_idx(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q, True)
    q_start = tl.load(query_start_loc_ptr + seq_idx)
    q_len = tl.load(query_start_loc_ptr + seq_idx + 1) - q_start
    q_block = q_block_global - (q_start // BLOCK_Q + seq_idx)
    if q_block * BLOCK_Q >= q_len:
        return  # the grid is an upper bound on q-blocks
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    context_len = seq_len - q_len  # cached prefix keys before this step's queries

    # Rows of the q-block: BLOCK_Q tokens x the kv head's query heads.
    offs_m = tl.arange(0, BLOCK_M)
    q_pos = q_block * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV
    # Rows past BLOCK_Q * group (group not a power of two) would alias the next block.
    row_mask = (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_pos < q_len)
    token = (q_start + q_pos).to(tl.int64)
    q_rows = token * q_stride_0 + head * q_stride_1

    offs_r = tl.arange(0, ROT_HALF_PADDED)
    r_mask = offs_r < ROT_HALF
    dim_1, dim_2 = _pair_dims(offs_r, ROT_HALF, IS_NEOX)
    q_r_mask = row_mask[:, None] & r_mask[None, :]
    q1 = tl.load(q_ptr + q_rows[:, None] + dim_1[None, :], mask=q_r_mask, other=0.0)
    q2 = tl.load(q_ptr + q_rows[:, None] + dim_2[None, :], mask=q_r_mask, other=0.0)
    if PASS_SIZE > 0:
        offs_p = tl.arange(0, PASS_PADDED)
        p_mask = offs_p < PASS_SIZE
        dim_p = 2 * ROT_HALF + offs_p
        q3 = tl.load(q_ptr + q_rows[:, None] + dim_p[None, :],
                     mask=row_mask[:, None] & p_mask[None, :], other=0.0)
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    d_mask = offs_d < HEAD_SIZE

    # Causal: the q-block's last row sees keys [0, context_len + its position].
    kv_hi = tl.minimum(context_len + (q_block + 1) * BLOCK_Q, seq_len)
    num_tiles = _cdiv(kv_hi, TILE_SIZE)
    if IS_3D:
        # Same split as _reduce_splits: splits past the keys are skipped.
        tiles_per_split = _cdiv(seq_len, NUM_SPLITS * TILE_SIZE)
        if split * tiles_per_split * TILE_SIZE >= seq_len:
            return
        tile_lo = split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    else:
        tile_lo = 0
        tile_hi = num_tiles

    M = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    L = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PADDED], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq_idx.to(tl.int64) * block_table_stride
    query_abs_pos = context_len + q_pos
    if HAS_SPAN_TABLES:
        span_row = seq_idx.to(tl.int64) * span_table_stride
        # The table is a*cos, a*sin (a = row 0's cos: 1 unless an mscale is folded in);
        # moving keys between frames is a pure rotation.
        inv_a = 1.0 / tl.load(cos_sin_ptr + offs_r, mask=r_mask, other=1.0)
        q_span, q_context = _span_and_context(span_of_ptr, context_pos_ptr, span_row,
                                              query_abs_pos, row_mask, SPAN_BLOCK)
        # Links take no room (SpanLayout.links_end): queries at or past links_end score
        # the keys before it with Q turned back by link_tokens; 0 without links.
        links_end = tl.load(links_end_ptr + seq_idx)
        q1_back, q2_back = _turned_back(q1, q2, cos_sin_ptr, cos_sin_stride,
                                        tl.load(link_tokens_ptr + seq_idx), offs_r, r_mask,
                                        ROT_HALF)
        after_links = (query_abs_pos >= links_end)[:, None]
        q1_near = tl.where(after_links, q1_back, q1)
        q2_near = tl.where(after_links, q2_back, q2)
        # A q-block with no row past the links (links, spans, plain prompts) takes one
        # dot per tile; one with such rows scores the tiles before links_end twice.
        # (An if/else with a dot in each branch measured slower on the H200: 93 vs 62 ms
        # for a 10-document EPIC hit, the loop's pipelining lost.)
        q_last = tl.minimum(context_len + (q_block + 1) * BLOCK_Q, seq_len) - 1
        some_after = (q_last >= links_end) & (links_end > 0)

    # Keys this program reads: the causal bound, and its split's end in 3D.
    kv_end = tl.minimum(kv_hi, tile_hi * TILE_SIZE)
    if PREFETCH:
        # Software pipelining by hand: the rotation consumes K in registers, so
        # Triton's pipeliner (which stages dot operands) does not prefetch it.
        k1_next, k2_next = _load_k_tile(
            tile_lo, kv_end, block_table_row, k_cache_ptr, kv_head, dim_1, dim_2, r_mask,
            k_stride_0, k_stride_1, k_stride_2, k_stride_3, BLOCK_SIZE, TILE_SIZE)
    for j in range(tile_lo, tile_hi):
        offs_t = j * TILE_SIZE + tl.arange(0, TILE_SIZE)  # key indices
        t_mask = offs_t < kv_end
        block = tl.load(block_table_row + offs_t // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        slot = (offs_t % BLOCK_SIZE).to(tl.int64)
        if PREFETCH:  # take tile j, start loading tile j+1 (past the end: all masked)
            k1, k2 = k1_next, k2_next
            k1_next, k2_next = _load_k_tile(
                j + 1, kv_end, block_table_row, k_cache_ptr, kv_head, dim_1, dim_2, r_mask,
                k_stride_0, k_stride_1, k_stride_2, k_stride_3, BLOCK_SIZE, TILE_SIZE)
        else:
            k1, k2 = _load_k_tile(
                j, kv_end, block_table_row, k_cache_ptr, kv_head, dim_1, dim_2, r_mask,
                k_stride_0, k_stride_1, k_stride_2, k_stride_3, BLOCK_SIZE, TILE_SIZE)
        if HAS_SPAN_TABLES:  # keys out of their frames: key j at j (links: logical)
            cos, sin = _frame_cos_sin(frame_offset_ptr, span_row, offs_t, t_mask, cos_sin_ptr,
                                      offs_r, r_mask, cos_sin_stride, inv_a, SPAN_BLOCK,
                                      ROT_HALF)
            r1, r2 = _rotate_pair(k1, k2, cos, sin)
            k1, k2 = r1.to(q1.dtype), r2.to(q1.dtype)
        else:
            k1 = k1.to(q1.dtype)
            k2 = k2.to(q1.dtype)
        k_base = k_cache_ptr + block * k_stride_0 + slot * k_stride_1 + kv_head * k_stride_2

        S = tl.dot(q1, k1)
        S = tl.dot(q2, k2, S)
        if HAS_SPAN_TABLES:
            if some_after & (j * TILE_SIZE < links_end):  # keys before the links' end
                S_near = tl.dot(q1_near, k1)
                S_near = tl.dot(q2_near, k2, S_near)
                S = tl.where((offs_t < links_end)[None, :], S_near, S)
        if PASS_SIZE > 0:
            k3 = tl.load(k_base[None, :] + dim_p[:, None] * k_stride_3,
                         mask=p_mask[:, None] & t_mask[None, :], other=0.0)
            S = tl.dot(q3, k3.to(q1.dtype), S)
        S = S * qk_scale
        visible = row_mask[:, None] & (offs_t[None, :] <= query_abs_pos[:, None])
        if HAS_SPAN_TABLES:
            k_span, k_context = _span_and_context(span_of_ptr, context_pos_ptr, span_row,
                                                  offs_t, t_mask, SPAN_BLOCK)
            visible = visible & _span_visible(q_span, q_context, k_span, k_context)
        if HAS_QUIET:
            visible = visible & _seen_if_quiet(quiet_ptr, seq_idx, quiet_stride, offs_t, t_mask,
                                               query_abs_pos, q_span)
        S = tl.where(visible, S, float("-inf"))

        # Online softmax (base 2). M stays the true running max, -inf while a row has
        # seen nothing (tiles before its span's start); the exponents use a copy that is
        # 0 there, so exp2(-inf - max) is 0, not NaN. Were M itself set to 0, a span
        # whose logits are all far below 0 would be weighed against 0, not its own max,
        # and its weights would underflow to an output of zeros.
        M_new = tl.maximum(M, tl.max(S, axis=1))
        M_exp = tl.where(M_new > float("-inf"), M_new, 0.0)
        P = tl.exp2(S - M_exp[:, None])
        alpha = tl.exp2(M - M_exp)
        L = L * alpha + tl.sum(P, axis=1)
        M = M_new

        v_base = v_cache_ptr + block * v_stride_0 + slot * v_stride_1 + kv_head * v_stride_2
        V = tl.load(v_base[:, None] + offs_d[None, :] * v_stride_3,
                    mask=t_mask[:, None] & d_mask[None, :], other=0.0)
        acc = tl.dot(P.to(V.dtype), V, acc * alpha[:, None])

    if IS_3D:
        # Unnormalised partials; _reduce_splits rescales and sums them.
        split_row = (token * NUM_QUERY_HEADS + head) * NUM_SPLITS + split
        tl.store(split_out_ptr + split_row[:, None] * HEAD_SIZE_PADDED + offs_d[None, :], acc,
                 mask=row_mask[:, None] & d_mask[None, :])
        # A row that saw no key here (causal or span cut) must not set the common max.
        tl.store(split_max_ptr + split_row, tl.where(L > 0.0, M, float("-inf")), mask=row_mask)
        tl.store(split_expsum_ptr + split_row, L, mask=row_mask)
    else:
        # Padding rows never saw a key (L = 0); they are not stored, keep them finite.
        out = acc / tl.where(L > 0.0, L, 1.0)[:, None]
        out_rows = token * out_stride_0 + head * out_stride_1
        tl.store(out_ptr + out_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["num_seqs"])
def _reduce_splits(
    out_ptr,
    split_out_ptr,
    split_max_ptr,
    split_expsum_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    num_seqs: tl.int32,
    out_stride_0: tl.int64,
    out_stride_1: tl.int64,
    NUM_QUERY_HEADS: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """Merge one (token, head)'s split-KV partials: rescale to a common max, sum, normalise."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    seq_idx = _find_seq_idx(query_start_loc_ptr, token, num_seqs, 1, False)
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    # Padded requests can have seq_len 0: keep the divisor non-zero.
    tiles_per_split = tl.maximum(_cdiv(seq_len, NUM_SPLITS * TILE_SIZE), 1)
    used = _cdiv(seq_len, tiles_per_split * TILE_SIZE)

    offs_s = tl.arange(0, NUM_SPLITS)
    s_mask = offs_s < used
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    d_mask = offs_d < HEAD_SIZE
    row = (token.to(tl.int64) * NUM_QUERY_HEADS + head) * NUM_SPLITS + offs_s
    m = tl.load(split_max_ptr + row, mask=s_mask, other=float("-inf"))
    m_all = tl.max(m, axis=0)
    w = tl.where(s_mask, tl.exp2(m - m_all), 0.0)
    total = tl.sum(tl.load(split_expsum_ptr + row, mask=s_mask, other=0.0) * w, axis=0)
    parts = tl.load(split_out_ptr + row[:, None] * HEAD_SIZE_PADDED + offs_d[None, :],
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    acc = tl.sum(parts * w[:, None], axis=0)
    out = tl.where(total > 0.0, acc / total, 0.0)
    tl.store(out_ptr + token * out_stride_0 + head * out_stride_1 + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Tile shape and schedule of one launch (`block_m` query rows x `tile_size` keys)."""

    block_m: int
    tile_size: int
    num_warps: int = 4
    num_stages: int = 3
    prefetch: bool = False  # load tile j+1's K while tile j is computed


# Launch shapes, chosen from the tile sweeps on an H200 (docs/attention.md).
# Split-KV decode (<= seq_threshold_3d requests): 32-key tiles (stock uses 16).
DECODE_3D = LaunchConfig(block_m=16, tile_size=32)
# Larger decode batches: wide tiles, K prefetched by hand.
DECODE_2D = LaunchConfig(block_m=16, tile_size=64, prefetch=True)
# Any batch with a query of more than one token, KV not split: every q-block rotates
# every K tile it reads, so the rotation costs in proportion to the number of q-blocks;
# large q-blocks amortise it (and feed the tensor cores larger dots). Short queries too:
# an ISPS step of 481 final prompts (32 tokens over 1056 keys) in DECODE_2D's 4-token
# q-blocks took 12.1 ms a layer on an H100, where FA3 took 0.95.
PREFILL = LaunchConfig(block_m=128, tile_size=64, num_warps=8, num_stages=2, prefetch=True)
# Head dims above 128: PREFILL's tiles overflow shared memory (seen at 256).
PREFILL_LARGE_HEAD = LaunchConfig(block_m=64, tile_size=32, num_warps=8, num_stages=2)
# Short queries with split KV (a span hit's final prompt): every q-block reads and turns
# every key of its split, so few, large q-blocks win. H200, 33 queries over 10k / 40k
# keys (bench_kernel --short-sweep): 0.18 / 0.65 ms against 0.54 / 2.04 ms for DECODE_2D's
# 4-token q-blocks.
SHORT_SPLIT = LaunchConfig(block_m=128, tile_size=64, num_warps=8, num_stages=3, prefetch=True)
# Queries shorter than this may split KV (_split_short_queries).
SPLIT_MAX_QUERY_LEN = 128
NUM_SPLITS = 16
# A 2D launch of fewer programs than this leaves SMs idle (vLLM's MIN_LAUNCH_GRID_SIZE_2D).
MIN_GRID_2D = 128
# Tokens of short-query batches that may split KV: minipic's builder sizes the buffers so.
SPLIT_KV_MAX_TOKENS = 128


def choose_config(max_seqlen_q: int, use_3d: bool, head_size: int = 128) -> LaunchConfig:
    large_head = head_size > 128
    if use_3d and max_seqlen_q > 1:
        return PREFILL_LARGE_HEAD if large_head else SHORT_SPLIT
    if use_3d:
        return DECODE_3D
    if max_seqlen_q <= 1:
        return DECODE_2D
    return PREFILL_LARGE_HEAD if large_head else PREFILL


def _q_block_rows(config: LaunchConfig, queries_per_kv: int) -> int:
    """A q-block's rows (BLOCK_M): the config's, at least one token's query heads."""
    return max(config.block_m, triton.next_power_of_2(queries_per_kv))


def _num_q_blocks(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Upper bound on sum_i ceil(q_len_i / block_q), known without a device read."""
    return num_tokens // block_q + num_seqs


def _split_decode(max_seqlen_q: int, num_seqs: int, seq_threshold_3d: int) -> bool:
    """Stock vLLM's rule: a decode batch too small to fill the GPU splits its KV."""
    return max_seqlen_q <= 1 and num_seqs <= seq_threshold_3d


def _split_short_queries(max_seqlen_q: int, num_tokens: int, num_seqs: int, queries_per_kv: int,
                         num_kv_heads: int, buffer_tokens: int, head_size: int) -> bool:
    """A few short queries over long cached contexts (a span-hit final prompt: ~30 new tokens
    after 10k cached keys) would launch a 2D grid of a few dozen programs, each walking every
    key, rotating as it goes. Split their KV too, when the scratch buffers hold the tokens."""
    if max_seqlen_q <= 1 or max_seqlen_q >= SPLIT_MAX_QUERY_LEN or num_tokens > buffer_tokens:
        return False
    # the q-blocks of the 2D launch it would otherwise take
    block_q = _q_block_rows(choose_config(max_seqlen_q, False, head_size),
                            queries_per_kv) // queries_per_kv
    return _num_q_blocks(num_tokens, num_seqs, block_q) * num_kv_heads <= MIN_GRID_2D


def _pow2_at_least_16(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def check_rope(head_size: int, rotary_dim: int, cos_sin: torch.Tensor) -> None:
    """Refuse rotations the kernel cannot apply (shape/dtype checks only: no device sync)."""
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_size:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and in (0, head_size={head_size}]")
    if cos_sin.dtype != torch.float32 or cos_sin.dim() != 2 or cos_sin.shape[1] != rotary_dim:
        raise ValueError(f"cos_sin must be fp32 [max_positions, {rotary_dim}], got "
                         f"{tuple(cos_sin.shape)} {cos_sin.dtype}")


def unified_attention_rope(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    max_seqlen_q: int,
    block_table: torch.Tensor,
    softmax_scale: float,
    cos_sin: torch.Tensor,
    rotary_dim: int,
    is_neox_style: bool,
    split_output: torch.Tensor | None = None,
    split_max: torch.Tensor | None = None,
    split_expsum: torch.Tensor | None = None,
    seq_threshold_3d: int | None = None,
    config: LaunchConfig | None = None,
    span_of: torch.Tensor | None = None,
    context_pos: torch.Tensor | None = None,
    frame_offset: torch.Tensor | None = None,
    span_block_size: int | None = None,
    links_end: torch.Tensor | None = None,
    link_tokens: torch.Tensor | None = None,
    quiet_bits: torch.Tensor | None = None,
    launches: dict | None = None,
) -> torch.Tensor:
    """Causal paged attention of `q` over K stored in frames, turning K tiles forward.

    q/out: [tokens, q_heads, head_size]; k_cache/v_cache: [blocks, block_size,
    kv_heads, head_size] (any strides, unit stride on the last dim). Request i
    owns tokens cu_seqlens_q[i]:cu_seqlens_q[i+1] and keys 0..seqused_k[i]-1
    (its cached prefix first), key j at position j. Decode batches of at
    most `seq_threshold_3d` requests, and short-query batches whose 2D grid would
    be small, split KV over the static `split_*` buffers (split_kv_buffers: vLLM's
    Triton metadata builder allocates them; minipic's enlarges them to
    SPLIT_KV_MAX_TOKENS).
    Host-side work is shape arithmetic only, so the launch can be captured in a
    CUDA graph.
    `span_of`, `context_pos` and `frame_offset` [seqs, blocks] int32
    (span_layout.SpanLayout, indexed by `span_block_size`-token blocks, same strides)
    turn each key forward by its frame offset and apply the span and link rules of
    span_layout.visible_keys per tile, and `links_end` / `link_tokens` [seqs] int32
    (SpanLayout: queries past a request's links score the keys before them
    link_tokens positions nearer); without them (HAS_SPAN_TABLES off) the launch is
    plain causal attention over K as stored and reads no table. Link tokens' Q must
    already be turned back (attention.links). `quiet_bits` [seqs, words] int32
    (quiet_words; with the span tables only): keys no query outside their own span sees.
    `launches`: a batch's segment_kernels.RepeatedLaunch cache, when every layer launches
    on the same tables (Triton binds the first layer's launch only).
    """
    num_tokens, num_q_heads, head_size = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seqused_k.shape[0]
    queries_per_kv = num_q_heads // num_kv_heads
    use_3d = split_output is not None and seq_threshold_3d is not None and (
        _split_decode(max_seqlen_q, num_seqs, seq_threshold_3d)
        or _split_short_queries(max_seqlen_q, num_tokens, num_seqs, queries_per_kv,
                                num_kv_heads, split_output.shape[0], head_size))
    if config is None:
        config = choose_config(max_seqlen_q, use_3d, head_size)
    block_m = _q_block_rows(config, queries_per_kv)
    block_q = block_m // queries_per_kv
    num_splits = split_output.shape[2] if use_3d else 1
    grid = (_num_q_blocks(num_tokens, num_seqs, block_q), num_kv_heads, num_splits)[
        : 3 if use_3d else 2]
    head_size_padded = triton.next_power_of_2(head_size)

    def bind(out, q, k_cache, v_cache):
        # The checks read only what a rebinding compares (segment_kernels.RepeatedLaunch).
        check_rope(head_size, rotary_dim, cos_sin)
        if q.stride(2) != 1 or out.stride(2) != 1:
            raise ValueError("q and out need a unit stride on the head dim")
        has_span_tables = _check_span_tables(span_of, context_pos, frame_offset, links_end,
                                             link_tokens, num_seqs)
        has_quiet = quiet_bits is not None
        if has_quiet:
            _check_quiet_bits(quiet_bits, has_span_tables, num_seqs)
        rot_half, pass_size = rotary_dim // 2, head_size - rotary_dim
        args = (
            out, q, k_cache, v_cache, cos_sin, block_table, seqused_k, cu_seqlens_q,
            span_of if has_span_tables else block_table,  # any pointer when unused
            context_pos if has_span_tables else block_table,
            frame_offset if has_span_tables else block_table,
            links_end if has_span_tables else seqused_k,
            link_tokens if has_span_tables else seqused_k,
            quiet_bits if has_quiet else seqused_k,
            split_output, split_max, split_expsum,
            softmax_scale * _LOG2E, num_seqs,
            block_table.stride(0), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            *k_cache.stride(), *v_cache.stride(), cos_sin.stride(0),
            span_of.stride(0) if has_span_tables else 0,
            quiet_bits.stride(0) if has_quiet else 0)
        return args, dict(
            NUM_QUERY_HEADS=num_q_heads, NUM_QUERIES_PER_KV=queries_per_kv,
            BLOCK_SIZE=block_size, TILE_SIZE=config.tile_size, HEAD_SIZE=head_size,
            HEAD_SIZE_PADDED=head_size_padded, ROT_HALF=rot_half,
            ROT_HALF_PADDED=_pow2_at_least_16(rot_half), PASS_SIZE=pass_size,
            PASS_PADDED=_pow2_at_least_16(pass_size) if pass_size else 16,
            IS_NEOX=is_neox_style, BLOCK_Q=block_q, BLOCK_M=block_m, NUM_SPLITS=num_splits,
            IS_3D=use_3d, PREFETCH=config.prefetch, HAS_SPAN_TABLES=has_span_tables,
            SPAN_BLOCK=span_block_size or block_size, HAS_QUIET=has_quiet,
            num_warps=config.num_warps, num_stages=config.num_stages)

    tables = (cos_sin, block_table, seqused_k, cu_seqlens_q, span_of, context_pos,
              frame_offset, links_end, link_tokens, quiet_bits)
    launch(minipic_attention_kernel, grid, bind, (out, q, k_cache, v_cache),
           (*tables, split_output, split_max, split_expsum, softmax_scale, config, use_3d,
            rotary_dim, is_neox_style, span_block_size, max_seqlen_q), launches, "attention")
    if use_3d:
        def bind_reduce(out):
            return (out, split_output, split_max, split_expsum, seqused_k, cu_seqlens_q,
                    num_seqs, out.stride(0), out.stride(1)), dict(
                NUM_QUERY_HEADS=num_q_heads, TILE_SIZE=config.tile_size, HEAD_SIZE=head_size,
                HEAD_SIZE_PADDED=head_size_padded, NUM_SPLITS=num_splits)

        launch(_reduce_splits, (num_tokens, num_q_heads), bind_reduce, (out,),
               (split_output, split_max, split_expsum, seqused_k, cu_seqlens_q, config,
                num_q_heads, head_size), launches, "reduce")
    return out


def span_table_args(layout, block_size: int, quiet_bits: torch.Tensor | None = None) -> dict:
    """unified_attention_rope's table arguments from a span_layout.SpanLayout.

    With mask_markers (`quiet_bits`, quiet_words of layout.quiet): keys are read at
    layout.read_offset, and links take no room through the positions Q and K were
    turned to (span_layout.token_shifts, key_turn_backs), so no query scores twice."""
    if quiet_bits is None:
        return dict(span_of=layout.span_of, context_pos=layout.context_pos,
                    frame_offset=layout.frame_offset, links_end=layout.links_end,
                    link_tokens=layout.link_tokens, span_block_size=block_size)
    no_links = torch.zeros_like(layout.links_end)
    return dict(span_of=layout.span_of, context_pos=layout.context_pos,
                frame_offset=layout.read_offset, links_end=no_links, link_tokens=no_links,
                span_block_size=block_size, quiet_bits=quiet_bits)


def quiet_words(quiet: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[reqs, tokens] bool -> [reqs, ceil(num_keys / 32)] int32 bits: bit k % 32 of word
    k // 32 is quiet[:, k] (the kernel reads a word per 32 keys, not a byte per key)."""
    words = -(-num_keys // 32)
    bits = torch.zeros(quiet.shape[0], words * 32, dtype=torch.int64, device=quiet.device)
    width = min(num_keys, quiet.shape[1])
    bits[:, :width] = quiet[:, :width].to(torch.int64)
    weights = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int64, device=quiet.device),
                                       torch.arange(32, device=quiet.device))
    packed = (bits.view(quiet.shape[0], words, 32) * weights).sum(-1)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


def _check_quiet_bits(quiet_bits: torch.Tensor, has_span_tables: bool, num_seqs: int) -> None:
    if not has_span_tables:
        raise ValueError("quiet_bits come with the span tables (mask_markers)")
    if quiet_bits.dtype != torch.int32 or quiet_bits.dim() != 2 \
            or quiet_bits.shape[0] < num_seqs or quiet_bits.stride(1) != 1:
        raise ValueError(f"quiet_bits must be int32 [>= {num_seqs}, words] with unit stride "
                         f"on words, got {quiet_bits.dtype} {tuple(quiet_bits.shape)}")


def _check_span_tables(span_of: torch.Tensor | None, context_pos: torch.Tensor | None,
                       frame_offset: torch.Tensor | None, links_end: torch.Tensor | None,
                       link_tokens: torch.Tensor | None, num_seqs: int) -> bool:
    """Whether the launch has span tables; all or none, int32, the block tables of one
    shape and stride, the link rows [>= seqs]."""
    tables = (span_of, context_pos, frame_offset, links_end, link_tokens)
    if all(t is None for t in tables):
        return False
    if any(t is None for t in tables):
        raise ValueError("span_of, context_pos, frame_offset, links_end and link_tokens "
                         "come together (span_layout.SpanLayout)")
    for table in (span_of, context_pos, frame_offset):
        if table.dtype != torch.int32 or table.dim() != 2 or table.stride(1) != 1:
            raise ValueError(f"span tables must be int32 [seqs, blocks] with unit stride on "
                             f"blocks, got {table.dtype} {tuple(table.shape)} {table.stride()}")
        if table.shape != span_of.shape or table.stride() != span_of.stride():
            raise ValueError("span_of, context_pos and frame_offset must share shape and strides")
    for table in (links_end, link_tokens):
        if table.dtype != torch.int32 or table.dim() != 1 or table.shape[0] < num_seqs \
                or table.stride(0) != 1:
            raise ValueError(f"links_end and link_tokens must be int32 [>= {num_seqs}] and "
                             f"contiguous, got {table.dtype} {tuple(table.shape)}")
    return True


def split_kv_buffers(max_tokens: int, num_q_heads: int, head_size: int,
                    device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split-KV scratch shaped like vLLM's Triton builder allocates it (tests, benchmarks)."""
    padded = triton.next_power_of_2(head_size)
    f32 = dict(dtype=torch.float32, device=device)
    return (torch.empty(max_tokens, num_q_heads, NUM_SPLITS, padded, **f32),
            torch.empty(max_tokens, num_q_heads, NUM_SPLITS, **f32),
            torch.empty(max_tokens, num_q_heads, NUM_SPLITS, **f32))


def default_softmax_scale(head_size: int) -> float:
    return 1.0 / math.sqrt(head_size)


@functools.cache  # once per process and shape: every KV cache group's builder asks
def compile_short_prefills(num_q_heads: int, num_kv_heads: int, head_size: int,
                           dtype: torch.dtype, rotary_dim: int, is_neox_style: bool,
                           block_size: int, device: torch.device) -> None:
    """Launch, on zeros, the two variants of the span kernel a short span prefill takes
    (cuda_backend.KERNEL_MAX_QUERY_TOKENS: split KV, and 2D for a 128-token query), as
    SpanBatchImpl.forward launches them (the split-KV scratch passed either way), so that
    Triton compiles them when the engine starts, not in the first span hit (seconds, every
    request of that step waiting). Besides the constexprs, Triton specializes on pointer
    alignment and on the strides of the queries, caches and cos/sin table, which hold for
    every batch of an engine, not on the sizes that change (SIZES_NOT_SPECIALIZED)."""
    def zeros(*shape, dtype=dtype):
        return torch.zeros(*shape, dtype=dtype, device=device)

    cache = zeros(2, block_size, num_kv_heads, head_size)
    q, out = zeros(2, num_q_heads, head_size), zeros(2, num_q_heads, head_size)
    tables = zeros(1, 2, dtype=torch.int32)
    per_request = zeros(1, dtype=torch.int32)
    split = split_kv_buffers(SPLIT_KV_MAX_TOKENS, num_q_heads, head_size, device)
    common = dict(cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32, device=device),
                  seqused_k=torch.full((1,), 2, dtype=torch.int32, device=device),
                  block_table=tables, softmax_scale=1.0,
                  cos_sin=zeros(2, rotary_dim, dtype=torch.float32), rotary_dim=rotary_dim,
                  is_neox_style=is_neox_style, span_of=tables, context_pos=tables,
                  frame_offset=tables, span_block_size=block_size, links_end=per_request,
                  link_tokens=per_request, split_output=split[0], split_max=split[1],
                  split_expsum=split[2], seq_threshold_3d=MIN_GRID_2D // num_kv_heads)
    for max_seqlen_q in (2, SPLIT_MAX_QUERY_LEN):  # split KV below SPLIT_MAX_QUERY_LEN
        unified_attention_rope(q, cache, cache, out, max_seqlen_q=max_seqlen_q, **common)
