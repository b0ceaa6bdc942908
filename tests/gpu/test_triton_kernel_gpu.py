"""minipic's Triton kernel on a CUDA GPU: against the torch reference and stock vLLM.

The reference rotates each request's keys by position and runs causal attention
(or the span and link rules) in fp64; the kernel reads keys stored in their
frames (make_case). Most cases have random SSep spans, so every K tile is turned
by real frame offsets; stock vLLM's `unified_attention` runs on plain cases with
keys rotated at their positions (what stock vLLM stores). Batches mix what a vLLM
step holds: decodes, chunked prefills with a cached prefix, fresh prefills.
"""

from __future__ import annotations

import pytest
import torch

from minipic.attention import triton_kernel as tk
from minipic.devtools.paged_attention_case import (epic_markers, make_case, random_segments,
                                                   reference_attention, relative_error)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (query_lens, context_lens) per batch kind
BATCHES = {
    # longest query >= SPLIT_MAX_QUERY_LEN: the large-q-block prefill launch, never split
    "mixed_long": ([1, 200, 37, 1, 150], [50, 133, 0, 1000, 0]),
    # short chunks with decodes: prefill's 2D launch (decodes alone take 16-row q-blocks)
    "mixed_short": ([1, 5, 17, 1], [300, 20, 0, 64]),
    # few decodes: split-KV (3D) launch + segment reduction
    "decode_split": ([1, 1, 1], [1000, 31, 4097]),
    # many decodes: 2D launch
    "decode_many": ([1] * 24, [17 * i + 3 for i in range(24)]),
}
TOLERANCE = {torch.bfloat16: 1.5e-2, torch.float16: 4e-3}
SEQ_THRESHOLD_3D = 16


def run_minipic(case, config=None, threshold=SEQ_THRESHOLD_3D, buffer_tokens=None):
    out = torch.full_like(case.q, float("nan"))  # poisoned: every row must be written
    split = tk.split_kv_buffers(buffer_tokens or max(threshold, 1), case.q.shape[1],
                              case.q.shape[2], "cuda")
    tk.unified_attention_rope(
        case.q, case.k_cache, case.v_cache, out, cu_seqlens_q=case.cu_seqlens_q,
        seqused_k=case.seq_lens, max_seqlen_q=case.max_seqlen_q, block_table=case.block_table,
        softmax_scale=case.scale, cos_sin=case.cos_sin, rotary_dim=case.rotary_dim,
        is_neox_style=case.is_neox, split_output=split[0], split_max=split[1],
        split_expsum=split[2], seq_threshold_3d=threshold, config=config, **span_tables(case))
    torch.cuda.synchronize()
    return out


def span_tables(case) -> dict:
    if case.layout is None:
        return {}
    return tk.span_table_args(case.layout, case.block_size)


def check(batch, *, num_q_heads=8, num_kv_heads=2, head_size=128, rotary_dim=None,
          is_neox=True, dtype=torch.bfloat16, config=None, seed=0, mscale=1.0):
    """A batch with random SSep spans (keys in their frames, turned by the kernel)."""
    import random

    rng = random.Random(f"{batch}{seed}")
    query_lens, context_lens = BATCHES[batch]
    case = make_case(query_lens, context_lens, num_q_heads=num_q_heads,
                     num_kv_heads=num_kv_heads, head_size=head_size, rotary_dim=rotary_dim,
                     is_neox=is_neox, dtype=dtype, device="cuda", seed=seed, mscale=mscale,
                     markers=[random_segments(q + c, 16, rng)
                              for q, c in zip(query_lens, context_lens)])
    assert case.layout.frame_offset.any()
    err = relative_error(run_minipic(case, config), reference_attention(case))
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"
    return case


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
def test_head_sizes_and_dtypes(batch, dtype, head_size):
    check(batch, head_size=head_size, dtype=dtype)


@pytest.mark.parametrize("batch", ["mixed_long", "mixed_short", "decode_split"])
@pytest.mark.parametrize("head_size,rotary_dim,is_neox", [
    (64, 64, False), (128, 128, False), (128, 64, True), (256, 64, False), (80, 32, True)])
def test_rotary_styles_and_partial_rotary(batch, head_size, rotary_dim, is_neox):
    check(batch, head_size=head_size, rotary_dim=rotary_dim, is_neox=is_neox)


@pytest.mark.parametrize("batch", ["mixed_long", "mixed_short", "decode_split"])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(32, 8), (8, 1), (6, 2), (4, 4), (32, 1)],
                         ids=["gqa4", "mqa8", "group3", "mha", "mqa32"])
def test_head_grouping(batch, num_q_heads, num_kv_heads):
    check(batch, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads)


@pytest.mark.parametrize("prefetch", [False, True], ids=["", "prefetch"])
@pytest.mark.parametrize("config", [tk.PREFILL, tk.DECODE_2D, tk.DECODE_3D, tk.SHORT_SPLIT,
                                    tk.LaunchConfig(block_m=64, tile_size=64)],
                         ids=["prefill", "decode2d", "decode3d", "short_split", "m64t64"])
def test_launch_configs(config, prefetch):
    import dataclasses

    config = dataclasses.replace(config, prefetch=prefetch)
    for batch in ("mixed_long", "decode_split"):
        check(batch, config=config)


@pytest.mark.parametrize("query_lens,context_lens", [([33], [10144]), ([5, 12, 1], [3000, 800, 64])],
                         ids=["span_hit", "short_mixed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_short_queries_split_kv(query_lens, context_lens, dtype):
    """Short queries over long contexts take the split-KV launch when the buffers hold them."""
    case = make_case(query_lens, context_lens, num_q_heads=32, num_kv_heads=8, head_size=128,
                     dtype=dtype, device="cuda")
    assert tk._split_short_queries(case.max_seqlen_q, case.q.shape[0], len(query_lens), 4, 8,
                                   tk.SPLIT_KV_MAX_TOKENS, 128)
    assert tk.choose_config(case.max_seqlen_q, True, 128) is tk.SHORT_SPLIT
    out = run_minipic(case, buffer_tokens=tk.SPLIT_KV_MAX_TOKENS)
    assert relative_error(out, reference_attention(case)) < TOLERANCE[dtype]


@pytest.mark.parametrize("batch", ["mixed_long", "decode_split"])
def test_layers_reuse_the_first_layers_binding(batch):
    """As an engine's span batch launches the kernel (cuda_backend: one launches cache a
    batch): every layer after the first reuses its binding (segment_kernels.RepeatedLaunch)
    with its own queries, caches and output, and gets what a launch of its own gives."""
    import dataclasses
    import random

    query_lens, context_lens = BATCHES[batch]
    rng = random.Random(batch)
    first = make_case(query_lens, context_lens, num_q_heads=32, num_kv_heads=8, head_size=128,
                      device="cuda", markers=[random_segments(q + c, 16, rng)
                                              for q, c in zip(query_lens, context_lens)])

    def other_layer(seed):  # new values, the same tables (unowned slots stay NaN)
        gen = torch.Generator(device="cuda").manual_seed(seed)

        def like(t):
            values = torch.randn(t.shape, generator=gen, device="cuda").to(t.dtype)
            return torch.where(t.isnan(), t, values)

        return dataclasses.replace(first, q=like(first.q), k_cache=like(first.k_cache),
                                   v_cache=like(first.v_cache))

    launches: dict = {}
    split = tk.split_kv_buffers(SEQ_THRESHOLD_3D, 32, 128, "cuda")
    for case in (first, other_layer(1), other_layer(2)):
        out = torch.full_like(case.q, float("nan"))
        tk.unified_attention_rope(
            case.q, case.k_cache, case.v_cache, out, cu_seqlens_q=case.cu_seqlens_q,
            seqused_k=case.seq_lens, max_seqlen_q=case.max_seqlen_q,
            block_table=first.block_table, softmax_scale=case.scale, cos_sin=first.cos_sin,
            rotary_dim=case.rotary_dim, is_neox_style=case.is_neox, split_output=split[0],
            split_max=split[1], split_expsum=split[2], seq_threshold_3d=SEQ_THRESHOLD_3D,
            launches=launches, **span_tables(first))
        torch.cuda.synchronize()
        assert torch.equal(out, run_minipic(case)), "a reused binding read another layer's"
    assert launches and all(launch.binds == 1 for launch in launches.values())


@pytest.mark.parametrize("batch", ["mixed_long", "decode_split"])
def test_scaled_rope_table_turns_keys_purely(batch):
    """A table with an mscale folded in (YaRN-like): keys move between frames by a pure
    rotation (the scale divided out), so scores keep the model's a^2."""
    check(batch, mscale=1.2)


@pytest.mark.parametrize("batch", ["mixed_long", "mixed_short", "decode_split", "decode_many"])
def test_equals_stock_vllm_on_prerotated_keys(batch):
    """Same answer as vLLM's own Triton kernel over the cache stock vLLM would hold."""
    stock = pytest.importorskip("vllm.v1.attention.ops.triton_unified_attention")
    query_lens, context_lens = BATCHES[batch]
    case = make_case(query_lens, context_lens, num_q_heads=32, num_kv_heads=8, head_size=128,
                     dtype=torch.bfloat16, device="cuda", seed=3)
    ref = reference_attention(case)
    ours = run_minipic(case)
    theirs = torch.full_like(case.q, float("nan"))
    split = tk.split_kv_buffers(SEQ_THRESHOLD_3D, 32, 128, "cuda")
    ones = torch.ones(1, device="cuda").expand(len(query_lens), 8)
    stock.unified_attention(
        q=case.q, k=case.rotated_k_cache(), v=case.v_cache, out=theirs,
        cu_seqlens_q=case.cu_seqlens_q, max_seqlen_q=case.max_seqlen_q,
        seqused_k=case.seq_lens, max_seqlen_k=case.max_seqlen_k, softmax_scale=case.scale,
        causal=True, window_size=(-1, -1), block_table=case.block_table, softcap=0,
        q_descale=None, k_descale=ones, v_descale=ones, seq_threshold_3D=SEQ_THRESHOLD_3D,
        num_par_softmax_segments=tk.NUM_SPLITS, softmax_segm_output=split[0],
        softmax_segm_max=split[1], softmax_segm_expsum=split[2])
    torch.cuda.synchronize()
    err_ours, err_stock = relative_error(ours, ref), relative_error(theirs, ref)
    assert err_ours < TOLERANCE[torch.bfloat16]
    assert err_ours < 2 * err_stock + 1e-3, (err_ours, err_stock)
    assert relative_error(ours, theirs) < TOLERANCE[torch.bfloat16]


def captured_decode(case, out: torch.Tensor, **span_tables) -> tuple:
    """A decode launch (32 q heads, head size 128, bf16 case) compiled, then captured; returns
    the graph and the split-KV buffers it writes, which the caller must keep alive."""
    split = tk.split_kv_buffers(SEQ_THRESHOLD_3D, 32, 128, "cuda")

    def step():
        tk.unified_attention_rope(
            case.q, case.k_cache, case.v_cache, out, cu_seqlens_q=case.cu_seqlens_q,
            seqused_k=case.seq_lens, max_seqlen_q=1, block_table=case.block_table,
            softmax_scale=case.scale, cos_sin=case.cos_sin, rotary_dim=128, is_neox_style=True,
            split_output=split[0], split_max=split[1], split_expsum=split[2],
            seq_threshold_3d=SEQ_THRESHOLD_3D, **span_tables)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph, split


def test_cuda_graph_replay_follows_new_lengths():
    """Captured once, replayed after the step's metadata changes in place (vLLM's static buffers)."""
    case = make_case([1, 1, 1, 1], [700, 90, 2500, 33], num_q_heads=32, num_kv_heads=8,
                     head_size=128, dtype=torch.bfloat16, device="cuda", seed=5)
    out = torch.empty_like(case.q)
    graph, _buffers = captured_decode(case, out)
    for shrink in (0, 1, 17):
        new_lens = torch.tensor([701, 91, 2501, 34], dtype=torch.int32) - shrink
        case.seq_lens.copy_(new_lens)  # one token shorter context, then more
        case.context_lens = [n - 1 for n in new_lens.tolist()]
        case.q.copy_(torch.randn_like(case.q))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(out, reference_attention(case)) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("batch", ["mixed_long", "mixed_short", "decode_split", "decode_many"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_span_segments(batch, dtype):
    import random

    rng = random.Random(batch)
    query_lens, context_lens = BATCHES[batch]
    segments = [random_segments(q + c, 16, rng) for q, c in zip(query_lens, context_lens)]
    case = make_case(query_lens, context_lens, num_q_heads=8, num_kv_heads=2, head_size=128,
                     dtype=dtype, device="cuda", seed=3, markers=segments)
    for config in (None, tk.PREFILL, tk.DECODE_2D):
        err = relative_error(run_minipic(case, config), reference_attention(case))
        assert err < TOLERANCE[dtype], f"{config}: relative error {err:.2e}"


# (query_lens, context_lens, markers): the EPIC hit (spans cached, links and task computed),
# a whole EPIC prompt, decodes after the links (replaced heads hidden), a plain request
LINK_BATCHES = {
    "hit_and_decode": ([160 + 40, 1, 1, 7], [16 + 640, 800, 16 + 288 + 96 + 50, 20],
                       [epic_markers(10, 4, 1, 3), epic_markers(3, 12, 2, 8),
                        epic_markers(3, 6, 2, 5), ""]),
    "whole_prompt": ([16 + 288 + 96 + 50, 130], [0, 0],
                     [epic_markers(3, 6, 2, 5), epic_markers(2, 3, 1, 2)]),
    "decode_split": ([1, 1, 1], [16 + 640 + 160 + 30, 810, 33],
                     [epic_markers(10, 4, 1, 3), epic_markers(3, 12, 2, 8), "-SL"]),
}


@pytest.mark.parametrize("batch", sorted(LINK_BATCHES))
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(32, 8), (6, 2), (8, 1)],
                         ids=["gqa4", "group3", "mqa8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_link_blocks(batch, num_q_heads, num_kv_heads, dtype):
    """EPIC link blocks: the kernel's per-tile rule equals span_layout.visible_keys."""
    query_lens, context_lens, markers = LINK_BATCHES[batch]
    case = make_case(query_lens, context_lens, num_q_heads=num_q_heads,
                     num_kv_heads=num_kv_heads, head_size=128, dtype=dtype, device="cuda",
                     seed=4, markers=markers)
    assert case.layout.shift.any()  # the case has links
    for config in (None, tk.PREFILL, tk.DECODE_2D, tk.DECODE_3D):
        err = relative_error(run_minipic(case, config, buffer_tokens=tk.SPLIT_KV_MAX_TOKENS),
                             reference_attention(case))
        assert err < TOLERANCE[dtype], f"{config}: relative error {err:.2e}"


def test_cuda_graph_replay_reads_span_tables():
    """A launch captured while the static span tables said "no spans" (as the backend
    captures) follows the link layout written into them before the replay."""
    query_lens, context_lens, markers = LINK_BATCHES["decode_split"]
    case = make_case(query_lens, context_lens, num_q_heads=32, num_kv_heads=8, head_size=128,
                     dtype=torch.bfloat16, device="cuda", seed=6, markers=markers)
    span_of = torch.full_like(case.layout.span_of, -1)
    context_pos = (torch.arange(span_of.shape[1], dtype=torch.int32, device="cuda") * 16
                   ).expand(span_of.shape).contiguous()
    frame_offset = torch.zeros_like(span_of)
    links_end, link_tokens = (torch.zeros_like(case.layout.links_end) for _ in range(2))
    out = torch.empty_like(case.q)
    graph, _buffers = captured_decode(case, out, span_of=span_of, context_pos=context_pos,
                                      frame_offset=frame_offset, links_end=links_end,
                                      link_tokens=link_tokens, span_block_size=16)
    for static, found in ((span_of, case.layout.span_of), (context_pos, case.layout.context_pos),
                          (frame_offset, case.layout.frame_offset),
                          (links_end, case.layout.links_end),
                          (link_tokens, case.layout.link_tokens)):
        static.copy_(found)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(out, reference_attention(case)) < TOLERANCE[torch.bfloat16]
