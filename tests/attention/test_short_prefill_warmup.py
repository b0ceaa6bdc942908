"""triton_kernel.compile_short_prefills warms, at engine start-up, every variant of the span
kernel that a short span prefill launches (cuda_backend.KERNEL_MAX_QUERY_TOKENS), so that no
span hit waits for Triton's compiler. A variant is what Triton compiles anew for: the
constexprs, and for each other argument that it specializes (pointer alignment; an int being
1 or a multiple of 16, unless the kernel says do_not_specialize). No kernel runs here: the
launches are recorded as the engine's forward would make them."""

from __future__ import annotations

import pytest
import torch

from minipic.attention import triton_kernel as tk

Q_HEADS, KV_HEADS, HEAD, BLOCK = 32, 8, 128, 16


def _variant(kernel, args: tuple, constexprs: dict) -> tuple:
    skip = set(getattr(kernel, "do_not_specialize", ())) | set(kernel.constexprs)
    names = kernel.arg_names
    runtime = []
    for i, arg in enumerate(args):
        if i in skip or names[i] in skip:
            continue
        if isinstance(arg, torch.Tensor):
            runtime.append((arg.dtype, arg.data_ptr() % 16 == 0))
        elif isinstance(arg, bool) or arg is None:
            runtime.append(arg)
        elif isinstance(arg, int):
            runtime.append((arg == 1, arg % 16 == 0))
    return kernel.fn.__name__, tuple(sorted(constexprs.items())), tuple(runtime)


@pytest.fixture
def recorded(monkeypatch):
    seen: list[tuple] = []

    def record(kernel, grid, bind, tensors, fixed, launches, name):
        args, constexprs = bind(*tensors)
        seen.append(_variant(kernel, args, constexprs))

    monkeypatch.setattr(tk, "launch", record)
    return seen


def _engine_launch(query_lens: list[int], context: int, max_model_len: int = 8192) -> None:
    """unified_attention_rope as SpanBatchImpl.forward calls it on a short span prefill: the
    queries a view of the model's fused QKV, the builder's scratch and tables."""
    tokens = sum(query_lens)
    qkv = torch.zeros(tokens, (Q_HEADS + 2 * KV_HEADS) * HEAD, dtype=torch.bfloat16)
    q = qkv[:, : Q_HEADS * HEAD].view(tokens, Q_HEADS, HEAD)
    out = torch.zeros(tokens, Q_HEADS, HEAD, dtype=torch.bfloat16)
    cache = torch.zeros(40, BLOCK, KV_HEADS, HEAD, dtype=torch.bfloat16)
    reqs = len(query_lens)
    layout_width = 32 * -(-(context + max(query_lens)) // (32 * BLOCK))  # _host_layout's steps
    tables = torch.zeros(reqs, layout_width, dtype=torch.int32)
    threshold = tk.MIN_GRID_2D // KV_HEADS
    split = tk.split_kv_buffers(max(tk.SPLIT_KV_MAX_TOKENS, threshold), Q_HEADS, HEAD, "cpu")
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    tk.unified_attention_rope(
        q, cache, cache, out, cu_seqlens_q=starts,
        seqused_k=torch.full((reqs,), context + max(query_lens), dtype=torch.int32),
        max_seqlen_q=max(query_lens),
        block_table=torch.zeros(reqs, -(-max_model_len // BLOCK), dtype=torch.int32),
        softmax_scale=HEAD ** -0.5, cos_sin=torch.zeros(max_model_len, HEAD),
        rotary_dim=HEAD, is_neox_style=True, split_output=split[0], split_max=split[1],
        split_expsum=split[2], seq_threshold_3d=threshold, span_of=tables,
        context_pos=tables, frame_offset=tables, span_block_size=BLOCK,
        links_end=torch.zeros(reqs, dtype=torch.int32),
        link_tokens=torch.zeros(reqs, dtype=torch.int32))


BATCHES = {  # name: (query lens, cached context)
    "hit_question": ([33], 10144),
    "three_questions": ([33, 40, 20], 3000),
    "sixteen_short": ([2] * 16, 500),
    "at_the_limit": ([128], 10144),
}


@pytest.mark.parametrize("name", BATCHES)
def test_start_up_warms_what_a_short_span_prefill_launches(recorded, name):
    tk.compile_short_prefills.cache_clear()
    tk.compile_short_prefills(Q_HEADS, KV_HEADS, HEAD, torch.bfloat16, HEAD, True, BLOCK,
                              torch.device("cpu"))
    warmed = set(recorded)
    recorded.clear()
    _engine_launch(*BATCHES[name])
    assert recorded and set(recorded) <= warmed
