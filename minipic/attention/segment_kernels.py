"""Worker side (CUDA): the two small Triton kernels around a span batch's FlashAttention rows.

Per layer a span batch on FlashAttention runs four launches: `turn_rows` (every row's
queries gathered and turned back into the frame they read, one launch for both
calls), the causal and the non-causal FlashAttention call (one call for a decode
batch), and `merge_rows` (each query token's rows merged by their log-sum-exp). The
same launch turns the batch's new keys into their frames for the cache write
(`turn_rows_and_keys`: launches, not memory, set these kernels' time). In torch
the turns and the merge take some thirty small launches a layer, which cost more
than the attention itself on a short task after a hit. Every layer of a batch launches
them on the same tables: the first layer's launch is bound by Triton, the others reuse
it (`RepeatedLaunch`), as Triton's binding is most of a launch's host time.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _turn_one_row(src, dst, cos_row, sin_row, src_stride_h, dst_stride_h,
                  HEADS: tl.constexpr, HEADS_PADDED: tl.constexpr, HEAD_SIZE: tl.constexpr,
                  ROT_HALF: tl.constexpr, HALF_PADDED: tl.constexpr,
                  PASS_PADDED: tl.constexpr, IS_NEOX: tl.constexpr):
    """All heads of one token, `src` to `dst`, turned by one row of cos and sin."""
    head = tl.arange(0, HEADS_PADDED)[:, None]
    head_mask = head < HEADS
    src = src + head * src_stride_h
    dst = dst + head * dst_stride_h
    r = tl.arange(0, HALF_PADDED)[None, :]
    r_mask = r < ROT_HALF
    if IS_NEOX:  # the two halves of the rotary dims are the (real, imag) pairs
        first, second = r, r + ROT_HALF
    else:  # GPT-J: even and odd dims
        first, second = 2 * r, 2 * r + 1
    mask = head_mask & r_mask
    x1 = tl.load(src + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + second, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_row + r, mask=r_mask, other=1.0)
    sin = tl.load(sin_row + r, mask=r_mask, other=0.0)
    tl.store(dst + first, (x1 * cos - x2 * sin).to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + second, (x2 * cos + x1 * sin).to(dst.dtype.element_ty), mask=mask)
    p = 2 * ROT_HALF + tl.arange(0, PASS_PADDED)[None, :]  # dims past rotary_dim pass
    p_mask = head_mask & (p < HEAD_SIZE)
    tl.store(dst + p, tl.load(src + p, mask=p_mask, other=0.0), mask=p_mask)


# Integers that change from batch to batch are not specialized on: Triton would compile the
# kernel again (about a second, with every request of the step waiting) the first time a
# batch's row count or offset is 1, a multiple of 16 or neither where earlier ones were not.
@triton.jit(do_not_specialize=["num_q_rows"])
def _turn_rows_kernel(q_ptr, index_ptr, cos_ptr, sin_ptr, out_ptr,
                      q_stride_t, q_stride_h, out_stride_t, out_stride_h, turn_stride,
                      k_ptr, k_cos_ptr, k_sin_ptr, k_out_ptr, k_stride_t, k_stride_h,
                      k_out_stride_t, k_out_stride_h, k_turn_stride, num_q_rows, count_ptr,
                      HEADS: tl.constexpr, HEADS_PADDED: tl.constexpr,
                      K_HEADS: tl.constexpr, K_HEADS_PADDED: tl.constexpr,
                      HEAD_SIZE: tl.constexpr, ROT_HALF: tl.constexpr,
                      HALF_PADDED: tl.constexpr, PASS_PADDED: tl.constexpr,
                      IS_NEOX: tl.constexpr, HAS_INDEX: tl.constexpr, HAS_KEYS: tl.constexpr,
                      HAS_COUNT: tl.constexpr):
    # One program per row, all heads at once: a program per (row, head) moved 256 bytes
    # and its launch grid, not the memory, set the kernel's time. With HAS_KEYS the
    # programs past num_q_rows turn new keys (token i by its own row), so a layer turns
    # its queries and its keys in one launch. With HAS_COUNT (a full CUDA graph's
    # fixed grid) the query rows from count_ptr[0] on are capacity: nothing to turn.
    # int64 offsets: rows x row stride passes 2^31 elements on long batches
    row = tl.program_id(0).to(tl.int64)
    is_key = False
    if HAS_KEYS:  # without keys is_key stays a constant and the compiler drops its branch
        is_key = row >= num_q_rows
    limit = num_q_rows
    if HAS_COUNT:
        limit = tl.load(count_ptr).to(tl.int64)
    if is_key:
        key = row - num_q_rows
        _turn_one_row(k_ptr + key * k_stride_t, k_out_ptr + key * k_out_stride_t,
                      k_cos_ptr + key * k_turn_stride, k_sin_ptr + key * k_turn_stride,
                      k_stride_h, k_out_stride_h, K_HEADS, K_HEADS_PADDED, HEAD_SIZE,
                      ROT_HALF, HALF_PADDED, PASS_PADDED, IS_NEOX)
    elif row < limit:
        if HAS_INDEX:
            token = tl.load(index_ptr + row).to(tl.int64)
        else:  # row i turns token i
            token = row
        _turn_one_row(q_ptr + token * q_stride_t, out_ptr + row * out_stride_t,
                      cos_ptr + row * turn_stride, sin_ptr + row * turn_stride,
                      q_stride_h, out_stride_h, HEADS, HEADS_PADDED, HEAD_SIZE,
                      ROT_HALF, HALF_PADDED, PASS_PADDED, IS_NEOX)


def turn_rows(query: torch.Tensor, index: torch.Tensor | None, cos: torch.Tensor,
              sin: torch.Tensor, rotary_dim: int, is_neox_style: bool,
              launches: dict | None = None) -> torch.Tensor:
    """[rows, heads, head_size]: query[index[i]] turned by (cos[i], sin[i]) (a
    rotation.Rotation's tables), in the query's dtype; index None: query[i], for the
    first cos.shape[0] tokens (the K turn before the cache write)."""
    return turn_rows_and_keys(query, index, cos, sin, rotary_dim, is_neox_style,
                              launches=launches)[0]


def turn_rows_and_keys(query: torch.Tensor, index: torch.Tensor | None, cos: torch.Tensor,
                       sin: torch.Tensor, rotary_dim: int, is_neox_style: bool,
                       key: torch.Tensor | None = None, key_cos: torch.Tensor | None = None,
                       key_sin: torch.Tensor | None = None, row_count: torch.Tensor | None = None,
                       launches: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """turn_rows' rows and, in the same launch, `key`'s first key_cos.shape[0] tokens
    [tokens, kv_heads, head_size] turned by (key_cos[i], key_sin[i]) (None without `key`).
    `row_count` [1] on the device: only the first row_count[0] rows are turned (the rest
    of `out` is left as it is). `launches`: a batch's RepeatedLaunch cache (every layer
    turns the same rows)."""
    rows, (_, heads, head_size) = cos.shape[0], query.shape
    out = torch.empty(rows, heads, head_size, dtype=query.dtype, device=query.device)
    keys = 0 if key is None else key_cos.shape[0]
    key_out = None if key is None else torch.empty(keys, *key.shape[1:], dtype=key.dtype,
                                                   device=key.device)
    if rows + keys == 0:
        return out, key_out

    def bind(query, key, out, key_out):
        assert query.stride(-1) == 1, "the kernel reads each head's dims as one run"
        half = rotary_dim // 2
        t_cos, t_sin = cos.contiguous(), sin.contiguous()
        if key is not None:
            assert key.stride(-1) == 1
            k, k_cos, k_sin, k_out = key, key_cos.contiguous(), key_sin.contiguous(), key_out
        else:  # the kernel never reads the key pointers: the query's stand in for them
            k, k_cos, k_sin, k_out = query, t_cos, t_sin, out
        # Without an index (or a count) the kernel never reads its pointer: any stands in.
        args = (query, t_cos if index is None else index, t_cos, t_sin, out, query.stride(0),
                query.stride(1), out.stride(0), out.stride(1), t_cos.stride(0),
                k, k_cos, k_sin, k_out, k.stride(0), k.stride(1), k_out.stride(0),
                k_out.stride(1), k_cos.stride(0), rows,
                t_cos if row_count is None else row_count)
        constexprs = dict(
            HEADS=heads, HEADS_PADDED=triton.next_power_of_2(heads), K_HEADS=k.shape[1],
            K_HEADS_PADDED=triton.next_power_of_2(k.shape[1]), HEAD_SIZE=head_size,
            ROT_HALF=half, HALF_PADDED=triton.next_power_of_2(half),
            PASS_PADDED=triton.next_power_of_2(max(head_size - rotary_dim, 1)),
            IS_NEOX=is_neox_style, HAS_INDEX=index is not None, HAS_KEYS=keys > 0,
            HAS_COUNT=row_count is not None)
        return args, constexprs

    launch(_turn_rows_kernel, (rows + keys,), bind, (query, key, out, key_out),
           (index, cos, sin, key_cos, key_sin, row_count, rotary_dim, is_neox_style), launches,
           "turn")
    return out, key_out


@triton.jit
def _no_keys_as_minus_inf(lse):
    """A row without keys: FA3 gives its LSE as -inf, FA2 as +inf (vLLM's
    merge_attn_states reads both so): -inf, no weight."""
    return tl.where(lse == float("inf"), float("-inf"), lse)


@triton.jit(do_not_specialize=["earlier_offset", "own_lse_stride_h", "earlier_lse_stride_h"])
def _merge_rows_kernel(own_ptr, own_lse_ptr, earlier_ptr, earlier_lse_ptr, starts_ptr,
                       entries_ptr, earlier_offset, out_ptr, own_stride_t, own_stride_h,
                       own_lse_stride_h, earlier_stride_t, earlier_stride_h,
                       earlier_lse_stride_h, out_stride_t, out_stride_h, HEADS: tl.constexpr,
                       HEADS_BLOCK: tl.constexpr, HEAD_SIZE: tl.constexpr,
                       HEAD_PADDED: tl.constexpr, ROWS_BLOCK: tl.constexpr):
    # One program per (token, HEADS_BLOCK heads), ROWS_BLOCK of the token's earlier rows a
    # load, in two passes (the largest LSE, then the weighted sum); int64 offsets.
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * HEADS_BLOCK + tl.arange(0, HEADS_BLOCK)
    head_mask = head < HEADS
    first = tl.load(starts_ptr + token)
    last = tl.load(starts_ptr + token + 1)
    own_lse = _no_keys_as_minus_inf(tl.load(own_lse_ptr + head * own_lse_stride_h + token,
                                            mask=head_mask, other=float("-inf")))
    rows = tl.arange(0, ROWS_BLOCK)
    peak = own_lse
    for chunk in range(first, last, ROWS_BLOCK):
        row_mask = chunk + rows < last
        entry = tl.load(entries_ptr + chunk + rows, mask=row_mask, other=0).to(tl.int64) \
            + earlier_offset
        lse = tl.load(earlier_lse_ptr + head[None, :] * earlier_lse_stride_h + entry[:, None],
                      mask=row_mask[:, None] & head_mask[None, :], other=float("-inf"))
        peak = tl.maximum(peak, tl.max(_no_keys_as_minus_inf(lse), axis=0))
    # a token whose rows read no keys (a full graph's padding request) gets 0, not NaN
    peak = tl.where(peak == float("-inf"), 0.0, peak)
    d = tl.arange(0, HEAD_PADDED)
    mask = head_mask[:, None] & (d < HEAD_SIZE)[None, :]
    weight = tl.exp(own_lse - peak)
    total = weight[:, None] * tl.load(
        own_ptr + token * own_stride_t + head[:, None] * own_stride_h + d[None, :],
        mask=mask, other=0.0).to(tl.float32)
    norm = weight
    for chunk in range(first, last, ROWS_BLOCK):
        row_mask = chunk + rows < last
        entry = tl.load(entries_ptr + chunk + rows, mask=row_mask, other=0).to(tl.int64) \
            + earlier_offset
        w = tl.exp(_no_keys_as_minus_inf(tl.load(
            earlier_lse_ptr + head[None, :] * earlier_lse_stride_h + entry[:, None],
            mask=row_mask[:, None] & head_mask[None, :], other=float("-inf"))) - peak[None, :])
        values = tl.load(earlier_ptr + entry[:, None, None] * earlier_stride_t
                         + head[None, :, None] * earlier_stride_h + d[None, None, :],
                         mask=row_mask[:, None, None] & mask[None, :, :],
                         other=0.0).to(tl.float32)
        total += tl.sum(w[:, :, None] * values, axis=0)
        norm += tl.sum(w, axis=0)
    norm = tl.where(norm == 0.0, 1.0, norm)
    tl.store(out_ptr + token * out_stride_t + head[:, None] * out_stride_h + d[None, :],
             (total / norm[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


# The merge's launch shape: a program per token over all heads, one earlier row a load, when
# the batch has tokens enough to fill the GPU (a long chunk: most tokens read one or two
# rows, and a program per head would make the grid, not memory, set the time, as it did for
# _turn_rows_kernel); else a program per (token, head) loading MERGE_ROWS_BLOCK rows at
# once: a 40-document hit's 32 question tokens read 41 rows each, which one program per
# token loading a row at a time took 53 us a layer to merge on 32 of 132 SMs.
MERGE_SPLIT_HEADS_BELOW = 1 << 16  # tokens x heads
MERGE_ROWS_BLOCK = 16


def merge_launch_shape(tokens: int, heads: int) -> tuple[int, int]:
    """(heads a program merges, earlier rows it loads at once) for a batch's merge."""
    if tokens * heads < MERGE_SPLIT_HEADS_BELOW:
        return 1, MERGE_ROWS_BLOCK
    return triton.next_power_of_2(heads), 1


def merge_rows(output: torch.Tensor, own_out: torch.Tensor, own_lse: torch.Tensor,
               earlier_out: torch.Tensor, earlier_lse: torch.Tensor, starts: torch.Tensor,
               entries: torch.Tensor, launches: dict | None = None,
               earlier_offset: int = 0, launch_shape: tuple[int, int] | None = None
               ) -> torch.Tensor:
    """output [n, heads, d]: each token's own row merged with its earlier rows
    entries[starts[t]:starts[t + 1]] (segment_plan.SegmentPlan.merge_starts), by LSE,
    read at earlier_offset + entry (one call's output holding both kinds of rows, the
    earlier after the own: no views to make). `launches`: as for turn_rows_and_keys.
    `launch_shape`: merge_launch_shape's pair, chosen for n tokens unless given (both
    shapes merge any batch alike)."""
    own_lse, earlier_lse = own_lse.float(), earlier_lse.float()
    n, heads, head_size = output.shape
    heads_block, rows_block = launch_shape or merge_launch_shape(n, heads)

    def bind(output, own_out, own_lse, earlier_out, earlier_lse):
        assert own_lse.stride(1) == 1 and earlier_lse.stride(1) == 1
        assert output.stride(-1) == own_out.stride(-1) == earlier_out.stride(-1) == 1
        args = (own_out, own_lse, earlier_out, earlier_lse, starts, entries, earlier_offset,
                output, own_out.stride(0), own_out.stride(1), own_lse.stride(0),
                earlier_out.stride(0), earlier_out.stride(1), earlier_lse.stride(0),
                output.stride(0), output.stride(1))
        return args, dict(HEADS=heads, HEADS_BLOCK=heads_block, HEAD_SIZE=head_size,
                          HEAD_PADDED=triton.next_power_of_2(head_size), ROWS_BLOCK=rows_block)

    launch(_merge_rows_kernel, (n, triton.cdiv(heads, heads_block)), bind,
           (output, own_out, own_lse, earlier_out, earlier_lse),
           (starts, entries, earlier_offset), launches, "merge")
    return output


@functools.cache  # once per process and shape: every KV cache group's builder asks
def compile_variants(num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
                     rotary_dim: int, is_neox_style: bool, device: torch.device,
                     max_tokens: int) -> None:
    """Launch, on a few rows of zeros, each variant of the turn and the merge that an eager
    span batch on FlashAttention rows launches: Triton compiles them here, at start-up, not
    in the first batch that needs one (about a second each on a fresh machine, every
    request of that step waiting). The variants: the queries turned with new keys and
    without, the new keys turned alone, and the merge's launch shapes for one to
    `max_tokens` tokens (the engine's batch limit). The queries and keys are views of one
    fused QKV row, as the model hands them (Triton specializes on their strides). A full
    decode graph's own variant (HAS_COUNT) compiles when vLLM captures the graphs."""
    def zeros(*shape, dtype=dtype):
        return torch.zeros(*shape, dtype=dtype, device=device)

    q_width, k_width = num_heads * head_size, num_kv_heads * head_size
    qkv = zeros(2, q_width + 2 * k_width)
    query = qkv[:, :q_width].view(2, num_heads, head_size)
    key = qkv[:, q_width: q_width + k_width].view(2, num_kv_heads, head_size)
    index = zeros(2, dtype=torch.int64)  # the plan's query_index is int64 (SegmentPlan.to)
    cos, sin = (zeros(2, rotary_dim // 2, dtype=torch.float32) for _ in range(2))
    turn_rows_and_keys(query, index, cos, sin, rotary_dim, is_neox_style, key, cos, sin)
    turn_rows(query, index, cos, sin, rotary_dim, is_neox_style)
    turn_rows(key, None, cos, sin, rotary_dim, is_neox_style)
    out, lse = zeros(1, num_heads, head_size), zeros(num_heads, 1, dtype=torch.float32)
    for shape in {merge_launch_shape(tokens, num_heads) for tokens in (1, max_tokens)}:
        merge_rows(out, out.clone(), lse, out.clone(), lse.clone(),
                   zeros(2, dtype=torch.int32), zeros(1, dtype=torch.int32),
                   launch_shape=shape)


def _launcher_takes_constexprs() -> bool:
    """Whether a compiled kernel's launcher takes every parameter in order, constexprs too
    (Triton 3.3 on), or the others only: decided as torch's inductor decides it, by the
    AttrsDescriptor that those Triton builds dropped (a git build may still say 3.2)."""
    import triton.backends.compiler
    import triton.compiler.compiler

    return not any(hasattr(module, "AttrsDescriptor")  # where 3.2 and 3.0-3.1 kept it
                   for module in (triton.backends.compiler, triton.compiler.compiler))


LAUNCHER_TAKES_CONSTEXPRS = _launcher_takes_constexprs()


def launch(kernel, grid: tuple, bind, tensors: tuple, fixed: tuple, launches: dict | None,
           name: str) -> None:
    """kernel[grid] on bind(*tensors) = (args, constexprs), where bind reads nothing but
    `tensors` and `fixed`; with a `launches` cache, through the RepeatedLaunch kept there
    under `name`."""
    if launches is None:
        args, constexprs = bind(*tensors)
        kernel[grid](*args, **constexprs)
        return
    repeated = launches.get(name)
    if repeated is None:
        repeated = launches[name] = RepeatedLaunch(kernel)
    repeated(grid, bind, tensors, fixed)


# What a bind may pass beside the kernel's parameters: they are compiled into the kernel.
LAUNCH_OPTIONS = {"num_warps", "num_stages"}


class RepeatedLaunch:
    """One Triton kernel launched again and again on the same arguments but for some
    tensors: a span batch's turn and merge, once a layer.

    Triton binds and specializes every argument at every launch, which is most of the
    host time of these launch-bound kernels (tens of microseconds a layer, eager decode's
    bottleneck). Here a launch goes through Triton unless the last one Triton bound had
    the same grid, the same `fixed` objects (tensors by identity: the bound arguments
    hold them, so their ids stay theirs) and `tensors` alike in all that Triton
    specializes on (dtype, 16-byte alignment) and the other arguments are computed from
    (shape, strides); then it reuses that launch's compiled kernel and arguments, the new
    tensors in place."""

    def __init__(self, kernel) -> None:
        self._kernel = kernel
        self._compiled = None  # None also under the Triton interpreter (no compiled kernel)
        self.binds = 0  # launches that went through Triton
        self._key = None
        self._fixed: tuple = ()  # held, so that no other object takes their ids
        self._grid: tuple = ()  # the compiled kernel's launcher takes all three sizes
        self._args: list = []  # what the compiled kernel's launcher takes (_launcher_args)
        self._slots: list[list[int]] = []  # where each tensor stands in _args

    def __call__(self, grid: tuple, bind, tensors: tuple, fixed: tuple) -> None:
        # Lists, not generators: this runs twice a layer, and its time is the launch's.
        ids = [id(t) for t in tensors]
        key = (grid, [id(f) if isinstance(f, torch.Tensor) else f for f in fixed],
               [None if t is None else (t.dtype, t.data_ptr() & 15, t.shape, t.stride())
                for t in tensors],
               # which tensors are one object: the slots found by identity hold for these
               list(map(ids.index, ids)))
        if self._compiled is None or key != self._key:
            args, constexprs = bind(*tensors)
            self._compiled = self._kernel[grid](*args, **constexprs)
            self.binds += 1
            self._key, self._fixed = key, fixed
            self._grid = (*grid, 1, 1)[:3]
            names = self._kernel.arg_names[len(args):]
            assert set(names) <= set(constexprs), "bind passes the last parameters by name"
            assert set(constexprs) - set(names) <= LAUNCH_OPTIONS, "bind passes every parameter"
            params = [*args, *(constexprs[name] for name in names)]
            self._args = _launcher_args(self._kernel, params, len(args))
            self._slots = [[i for i, a in enumerate(self._args) if t is not None and a is t]
                           for t in tensors]
            assert all(slots for slots, t in zip(self._slots, tensors) if t is not None), \
                "bind passes each tensor it is given as it is (a copy would never be swapped)"
            return
        args = self._args
        for slots, t in zip(self._slots, tensors):
            for slot in slots:
                args[slot] = t
        self._compiled[self._grid](*args)


def _launcher_args(kernel, params: list, positional: int) -> list:
    """What a compiled kernel's launcher takes of the kernel's parameters `params` (all, in
    order): all of them, or those but the constexprs (Triton before 3.3), which may stand
    among the positional ones (the span kernel's unit strides). Launchers check nothing
    (Triton 3.9's calls the enter hook before it reads an argument): the convention must
    be known, not tried (LAUNCHER_TAKES_CONSTEXPRS). Without Triton's list of constexpr
    places (a stand-in kernel), those passed by name."""
    if LAUNCHER_TAKES_CONSTEXPRS:
        return params
    constexprs = set(getattr(kernel, "constexprs", range(positional, len(params))))
    return [p for i, p in enumerate(params) if i not in constexprs]
