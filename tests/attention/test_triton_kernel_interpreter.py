"""minipic's Triton attention kernel under the Triton interpreter (CPU CI).

The interpreter is chosen when a kernel is decorated, so the cases run in a
child process that sets TRITON_INTERPRET=1 before anything imports triton
(vLLM, imported by other tests, imports triton too). A child runs the cases named
on its command line once each and prints one JSON line of relative errors; each
test checks its case. Two children run at once (the interpreter keeps a core busy
each): the kernel's cases, and the backend's (which import vLLM).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Header, span 1 (2 blocks), span 2 (2 blocks), link 1, link 2, PDep task (block size 16).
LINKS = "-S-S-LLP"

# name -> (make_case kwargs, launch options). Tiny shapes: the interpreter runs
# every program in numpy. Block size 16 as vLLM requires; tiles of 16 keys.
CASES = {
    "prefill_neox_fp16": (dict(query_lens=[9], context_lens=[0], num_q_heads=4, num_kv_heads=2,
                               head_size=64), {}),
    "mixed_prefix_gqa_fp16": (dict(query_lens=[1, 7, 20], context_lens=[20, 13, 0],
                                   num_q_heads=4, num_kv_heads=2, head_size=64), {}),
    "mqa_gptj_partial_fp32": (dict(query_lens=[5, 3], context_lens=[30, 2], num_q_heads=4,
                                   num_kv_heads=1, head_size=32, rotary_dim=16, is_neox=False,
                                   dtype="float32"), {}),
    "head80_neox_fp16": (dict(query_lens=[6, 1], context_lens=[11, 17], num_q_heads=2,
                              num_kv_heads=2, head_size=80), {}),
    "group3_fp32": (dict(query_lens=[4, 2], context_lens=[3, 14], num_q_heads=6, num_kv_heads=2,
                         head_size=32, dtype="float32"), {}),
    "decode_split_kv_fp16": (dict(query_lens=[1, 1, 1], context_lens=[40, 5, 70], num_q_heads=4,
                                  num_kv_heads=2, head_size=64), {"split_kv": True}),
    # keys turned between frames with a table that folds an mscale in: a pure rotation
    "frames_mscale_fp32": (dict(query_lens=[3, 1], context_lens=[77, 50], num_q_heads=2,
                                num_kv_heads=1, head_size=32, mscale=1.25, dtype="float32",
                                markers=["-S-S-LLP", "-SS-"]), {"config": "PREFETCH"}),
    "prefill_config_fp16": (dict(query_lens=[18], context_lens=[5], num_q_heads=2, num_kv_heads=1,
                                 head_size=32), {"config": "PREFILL_SMALL"}),
    "prefetch_mixed_fp16": (dict(query_lens=[1, 7, 20], context_lens=[40, 13, 0], num_q_heads=4,
                                 num_kv_heads=2, head_size=64), {"config": "PREFETCH"}),
    "prefetch_split_kv_fp32": (dict(query_lens=[1, 1], context_lens=[90, 7], num_q_heads=4,
                                    num_kv_heads=2, head_size=32, is_neox=False, dtype="float32"),
                               {"config": "PREFETCH", "split_kv": True}),
    # short queries over cached prefixes: split KV too (a span-hit final prompt)
    "short_split_kv_fp16": (dict(query_lens=[5, 3, 1], context_lens=[70, 40, 0], num_q_heads=4,
                                 num_kv_heads=2, head_size=64), {"split_kv": True}),
    # minipic span segments (markers: one character per block, see make_case): request 0 =
    # header block, SSep span of 2 blocks, PDep block; request 1 = decode inside an SSep
    # span that starts at its second block.
    "segments_mixed_fp16": (dict(query_lens=[60, 1], context_lens=[0, 40], num_q_heads=4,
                                 num_kv_heads=2, head_size=64, markers=["-S-P", "-S-"]), {}),
    "segments_split_kv_fp32": (dict(query_lens=[1, 1], context_lens=[40, 20], num_q_heads=4,
                                    num_kv_heads=2, head_size=32, dtype="float32",
                                    markers=["-SS", "-S"]), {"split_kv": True}),
    # the same, split: span queries see no key in the earlier KV splits
    "segments_short_split_kv_fp16": (dict(query_lens=[60, 1], context_lens=[0, 40],
                                          num_q_heads=4, num_kv_heads=2, head_size=64,
                                          markers=["-S-P", "-S-"]), {"split_kv": True}),
    # a span whose visible logits are all far below 0, after a tile it cannot see: the
    # softmax must be weighed against the span's own max, or its weights underflow
    "segments_negative_logits_fp16": (dict(query_lens=[1], context_lens=[63], num_q_heads=2,
                                           num_kv_heads=1, head_size=32, rotary_dim=16,
                                           markers=["--S-"]),
                                      {"config": "PREFILL_SMALL", "logit": -20.0}),
    # EPIC link blocks (LINKS): links 1 and 2 carry the first blocks of spans 1 and 2 at
    # their logical positions; the task sees them in place of the spans' solo heads.
    # Whole prompt at once, next to a plain request:
    "links_prefill_fp16": (dict(query_lens=[122, 9], context_lens=[0, 5], num_q_heads=4,
                                num_kv_heads=2, head_size=32, markers=[LINKS, ""]), {}),
    # the EPIC hit: header and spans cached, links and task computed
    "links_after_span_hit_fp16": (dict(query_lens=[42], context_lens=[80], num_q_heads=4,
                                       num_kv_heads=2, head_size=32, markers=[LINKS]),
                                  {"config": "PREFILL_SMALL"}),
    # decode after the links (the replaced heads stay hidden), 2D and split KV
    "links_decode_fp32": (dict(query_lens=[1, 1], context_lens=[121, 130], num_q_heads=4,
                               num_kv_heads=2, head_size=32, dtype="float32",
                               markers=[LINKS, LINKS + "-"]), {}),
    "links_decode_split_kv_fp16": (dict(query_lens=[1, 1], context_lens=[121, 100],
                                        num_q_heads=4, num_kv_heads=2, head_size=32,
                                        markers=[LINKS, "-S-S-L"]), {"split_kv": True}),
    "links_short_split_kv_fp16": (dict(query_lens=[42, 3], context_lens=[80, 40], num_q_heads=4,
                                       num_kv_heads=2, head_size=32, markers=[LINKS, "-SL"]),
                                  {"split_kv": True}),
    # GQA groups of 3 and of 4 (MQA-like rows sharing one K tile)
    "links_group3_fp32": (dict(query_lens=[42], context_lens=[80], num_q_heads=6,
                               num_kv_heads=2, head_size=32, dtype="float32", markers=[LINKS]),
                          {}),
    "links_mqa_gptj_fp16": (dict(query_lens=[122], context_lens=[0], num_q_heads=4,
                                 num_kv_heads=1, head_size=32, is_neox=False, markers=[LINKS]),
                            {"config": "PREFETCH"}),
}
TOLERANCE = {"float16": 3e-3, "float32": 1e-5}
# Through MiniPICFlashImpl.forward, a span batch, with the KV cache in each vLLM layout.
BACKEND_CASES = ("backend_forward_5d_cache", "backend_forward_4d_cache")
# Through the backend's KV cache write and forward with EPIC links: Q and K turned back.
BACKEND_LINK_CASE = "backend_links_turn_back_fp32"
# Through the builder, the KV cache write and forward with mask_markers: markers and
# padding hidden and taking no room (links too).
BACKEND_QUIET_CASE = "backend_mask_markers_fp32"


def _run_case(name: str) -> float:
    """Child process: run one case through the kernel, return its relative error."""
    import torch

    from minipic.attention import triton_kernel as tk
    from minipic.devtools.paged_attention_case import make_case, reference_attention, relative_error

    kwargs, opts = CASES[name]
    kwargs = dict(kwargs, dtype=getattr(torch, kwargs.get("dtype", "float16")))
    case = make_case(**kwargs, seed=len(name))
    if "logit" in opts:
        _set_every_logit(case, opts["logit"])
    out = torch.full_like(case.q, float("nan"))  # poisoned: every row must be written
    config = {
        None: None,
        "PREFILL_SMALL": tk.LaunchConfig(block_m=32, tile_size=16),
        "PREFETCH": tk.LaunchConfig(block_m=16, tile_size=16, prefetch=True),
    }[opts.get("config")]
    split = {}
    if opts.get("split_kv"):
        buffers = tk.split_kv_buffers(case.q.shape[0], case.q.shape[1], case.q.shape[2], "cpu")
        split = dict(zip(("split_output", "split_max", "split_expsum"), buffers),
                    seq_threshold_3d=8)
    tk.unified_attention_rope(
        case.q, case.k_cache, case.v_cache, out, cu_seqlens_q=case.cu_seqlens_q,
        seqused_k=case.seq_lens, max_seqlen_q=case.max_seqlen_q, block_table=case.block_table,
        softmax_scale=case.scale, cos_sin=case.cos_sin, rotary_dim=case.rotary_dim,
        is_neox_style=case.is_neox, config=config, **_span_tables(case), **split)
    return relative_error(out, reference_attention(case))


def _span_tables(case) -> dict:
    from minipic.attention import triton_kernel as tk

    if case.layout is None:
        return {}
    return tk.span_table_args(case.layout, case.block_size)


def _set_every_logit(case, logit: float) -> None:
    """Q and every K along the unrotated dims only, so that q.k * scale = `logit` at
    every position (V stays random)."""
    import torch

    direction = torch.zeros(case.q.shape[-1])
    direction[case.rotary_dim:] = 1.0
    owned = ~torch.isnan(case.k_cache)  # NaN marks slots no request owns
    k_cache = case.k_cache.float()
    k_cache[owned] = direction.expand_as(k_cache)[owned]
    case.k_cache = case.k_model = k_cache.to(case.q.dtype)  # no rotation touches these dims
    a = -logit / (direction.sum().item() * case.scale)
    case.q = (-a * direction).expand_as(case.q).contiguous().to(case.q.dtype)


def _run_backend_forward(name: str) -> float | str:
    """Child process: the backend's forward on vLLM-shaped inputs (needs vLLM importable)."""
    import importlib.util

    import torch

    if importlib.util.find_spec("vllm") is None:
        return "skipped: vllm is not installed"
    from minipic.attention import cuda_backend as fb
    from minipic.attention.rope import RopeParams
    from minipic.devtools.paged_attention_case import make_case, reference_attention, relative_error

    case = make_case([1, 6, 3], [33, 10, 0], num_q_heads=4, num_kv_heads=2, head_size=64,
                     markers=["-S-", "-S", "S"], seed=7)
    fb.current_rope = lambda: RopeParams(head_size=64, rotary_dim=case.rotary_dim,
                                         is_neox_style=case.is_neox, cos_sin_fp32=case.cos_sin)
    if name == "backend_forward_5d_cache":  # vLLM 0.25: [blocks, 2, block_size, heads, dim]
        kv_cache = torch.stack((case.k_cache, case.v_cache), dim=1)
    else:  # later: [blocks, heads, block_size, 2 * dim]
        kv_cache = torch.cat((case.k_cache, case.v_cache), dim=-1).transpose(1, 2).contiguous()
    k_view, v_view = fb.split_kv_cache(kv_cache, 64)
    assert torch.equal(k_view.nan_to_num(), case.k_cache.nan_to_num())
    assert torch.equal(v_view.nan_to_num(), case.v_cache.nan_to_num())
    out = torch.full_like(case.q, float("nan"))
    _flash_impl(fb, 64, case.scale).forward(None, case.q, None, None, kv_cache,
                                            _span_metadata(case, case.q), out)
    return relative_error(out, reference_attention(case))


def _flash_impl(fb, head_size: int, scale: float):
    """A MiniPICFlashImpl with what its span path reads (FlashAttention's own __init__
    looks for a FlashAttention build, which the CPU has not)."""
    impl = object.__new__(fb.MiniPICFlashImpl)
    impl.num_heads, impl.head_size, impl.scale, impl._cos_sin = 4, head_size, scale, None
    return impl


def _span_metadata(case, query):
    """FlashAttention-shaped metadata of a span batch, as MiniPICFlashMetadataBuilder
    leaves it."""
    from types import SimpleNamespace

    from minipic.attention import triton_kernel as tk

    return SimpleNamespace(
        num_actual_tokens=query.shape[0], query_start_loc=case.cu_seqlens_q,
        seq_lens=case.seq_lens, max_query_len=case.max_seqlen_q, block_table=case.block_table,
        causal=True, mm_prefix_range_tensor=None, minipic_tables=case.layout,
        minipic_span_block_size=case.block_size, minipic_token_shift=None,
        minipic_quiet_bits=None,
        minipic_split_kv_scratch=tk.split_kv_buffers(64, query.shape[1], query.shape[2], "cpu"),
        minipic_seq_threshold_3d=8, minipic_launches={}, minipic_kernel_args=None)


def _run_backend_links() -> float | str:
    """Child process: link tokens through MiniPICFlashImpl.do_kv_cache_update and forward,
    against attention computed at the tokens' logical positions (each link token at its
    index minus its shift, the task after the links minus the link tokens) under
    span_layout.visible_keys: no turn-back in the reference."""
    import importlib.util
    from types import SimpleNamespace

    import torch

    if importlib.util.find_spec("vllm") is None:
        return "skipped: vllm is not installed"
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    from minipic.attention import cuda_backend as fb
    from minipic.attention import rope as rope_registry
    from minipic.attention.links import token_turns
    from minipic.attention.rotation import rotate
    from minipic.attention.span_layout import key_turn_backs, token_shifts
    from minipic.devtools.paged_attention_case import make_case, relative_error

    # the EPIC hit (links and task computed over cached header and spans), a decode in a link
    case = make_case([42, 1], [80, 100], num_q_heads=4, num_kv_heads=2, head_size=32,
                     dtype=torch.float32, markers=[LINKS, "-S-S-L"], seed=11)
    layout, bs, dim = case.layout, case.block_size, 32
    rope_registry._current = rope_registry.RopeParams(
        head_size=dim, rotary_dim=case.rotary_dim, is_neox_style=case.is_neox,
        cos_sin_fp32=case.cos_sin)
    fb.current_rope = rope_registry.current_rope  # undo _run_backend_forward's stand-in
    seq_lens = case.seq_lens.tolist()
    shift = [layout.shift[i, torch.arange(n) // bs].long() for i, n in enumerate(seq_lens)]
    k_raw = [case.k_model[case.block_table[i, torch.arange(n) // bs].long(), torch.arange(n) % bs]
             for i, n in enumerate(seq_lens)]  # what the model computes, before RoPE

    # Every key written as the steps that computed them would: one write of all tokens,
    # each K as the model's RoPE hands it (rotated at its index).
    stored = {}
    FlashAttentionImpl.do_kv_cache_update = (
        lambda self, layer, key, value, kv_cache, slot_mapping: stored.update(key=key))
    whole = [0, *torch.tensor(seq_lens).cumsum(0).tolist()]
    fb.batch_metadata = lambda layer: SimpleNamespace(minipic_key_turn=token_turns(
        key_turn_backs(layout, whole, seq_lens, bs), torch.device("cpu")))
    impl = _flash_impl(fb, dim, case.scale)
    impl.do_kv_cache_update(None, torch.cat([
        rotate(k, torch.arange(k.shape[0]), case.cos_sin, case.rotary_dim, case.is_neox)
        for k in k_raw]), None, None, None)
    k_cache = case.k_cache.clone()
    for i, n in enumerate(seq_lens):
        rows = stored["key"][whole[i]: whole[i + 1]]
        k_cache[case.block_table[i, torch.arange(n) // bs].long(), torch.arange(n) % bs] = rows

    starts = case.cu_seqlens_q.tolist()
    q_raw = torch.randn(case.q.shape, generator=torch.Generator().manual_seed(5))
    physical = torch.cat([torch.arange(c, c + q) for q, c in zip(case.query_lens,
                                                                   case.context_lens)])
    query = rotate(q_raw, physical, case.cos_sin, case.rotary_dim, case.is_neox)  # the model's Q
    md = _span_metadata(case, query)
    md.minipic_token_shift = token_turns(token_shifts(layout, starts, seq_lens, bs),
                                         torch.device("cpu"))
    out = torch.full_like(query, float("nan"))
    impl.forward(None, query, None, None, torch.stack((k_cache, case.v_cache), dim=1), md, out)

    logical = []
    for i, n in enumerate(seq_lens):
        logical.append(torch.arange(n) - shift[i])
        logical[i][int(layout.links_end[i]):] -= int(layout.link_tokens[i])  # links take no room
    return relative_error(out, _logical_reference(case, layout, q_raw, k_raw, logical))


def _logical_reference(case, layout, q_raw, k_raw, logical):
    """fp64 attention with each request's Q and K rotated at its tokens' logical positions
    (`logical`, per request) under span_layout.visible_keys: no turn-back anywhere."""
    import torch

    from minipic.attention.rotation import rotate
    from minipic.attention.span_layout import visible_keys

    bs, starts = case.block_size, case.cu_seqlens_q.tolist()
    groups = case.q.shape[1] // case.k_cache.shape[2]
    ref = torch.empty(q_raw.shape, dtype=torch.float64)
    for i, n in enumerate(case.seq_lens.tolist()):
        q_len = case.query_lens[i]
        q = rotate(q_raw[starts[i]: starts[i + 1]], logical[i][n - q_len:], case.cos_sin,
                   case.rotary_dim, case.is_neox).double()
        k = rotate(k_raw[i], logical[i], case.cos_sin, case.rotary_dim, case.is_neox).double()
        v = case.v_cache[case.block_table[i, torch.arange(n) // bs].long(),
                         torch.arange(n) % bs].double()
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * case.scale
        scores = scores.masked_fill(~visible_keys(layout, i, n, q_len, bs), float("-inf"))
        ref[starts[i]: starts[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return ref


def _quiet_tokens(markers: str, seq_len: int, pads: int):
    """A request's token ids as minipic's recipes lay them out: each block's first token
    as `markers` says, the last `pads` tokens of the header and of every span's last
    block padding, and the k-th link block a copy of the k-th span's head."""
    import torch

    from minipic.devtools.paged_attention_case import MARKER_TOKENS, MARKERS

    bs = 16
    blocks = torch.full((len(markers), bs), 9)
    blocks[:, 0] = torch.tensor([MARKER_TOKENS[c] for c in markers])
    heads = [b for b, c in enumerate(markers) if c == "S"]
    for b, c in enumerate(markers[:-1]):
        if c in "-S" and markers[b + 1] != "-":  # the header's or a span's last block
            blocks[b, bs - pads:] = MARKERS.pad_token_id
    for k, b in enumerate(b for b, c in enumerate(markers) if c == "L"):
        blocks[b, 1:] = blocks[heads[k], 1:]
    return blocks.flatten()[:seq_len]


def _run_backend_mask_markers() -> float | str:
    """Child process: mask_markers through MiniPICFlashMetadataBuilder.build, the KV cache
    write and forward, for the EPIC hit (header and spans cached, links and task
    computed), a decode past its links, and a span at the prompt's start computed with
    the task after it (its queries see its SSep; the task reads it from one before the
    span: a negative frame offset), against attention at the tokens' logical positions
    under span_layout.visible_keys with quiet keys (the torch backend's rules)."""
    import importlib.util
    from types import SimpleNamespace

    import torch

    if importlib.util.find_spec("vllm") is None:
        return "skipped: vllm is not installed"
    from vllm.v1.attention.backends.flash_attn import (
        FlashAttentionImpl,
        FlashAttentionMetadataBuilder,
    )

    from minipic.attention import cuda_backend as fb
    from minipic.attention import rope as rope_registry
    from minipic.attention import triton_kernel as tk
    from minipic.attention.rotation import rotate
    from minipic.attention.span_layout import quiet_keys, span_layout, take_no_room
    from minipic.devtools.paged_attention_case import MARKERS, make_case, relative_error

    markers = [LINKS, "-S-S-LP", "S--P"]
    case = make_case([42, 1, 50], [80, 100, 0], num_q_heads=4, num_kv_heads=2, head_size=32,
                     dtype=torch.float32, markers=markers, seed=13)
    bs, dim, seq_lens = case.block_size, 32, case.seq_lens.tolist()
    width = case.block_table.shape[1] * bs
    tokens = torch.full((len(markers), width), 9)
    for i, (row, n) in enumerate(zip(markers, seq_lens)):
        tokens[i, :n] = _quiet_tokens(row.ljust(-(-n // bs), "-"), n, pads=3 + 2 * i)
    layout = span_layout(tokens[:, ::bs], MARKERS, bs, torch.tensor(seq_lens))
    take_no_room(layout, quiet_keys(tokens, MARKERS), bs)
    rope_registry._current = rope_registry.RopeParams(
        head_size=dim, rotary_dim=case.rotary_dim, is_neox_style=case.is_neox,
        cos_sin_fp32=case.cos_sin)
    fb.current_rope = rope_registry.current_rope  # undo _run_backend_forward's stand-in

    def build(query_lens: list[int]):
        """The builder's metadata for these query lengths over the case's sequences."""
        starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()],
                              dtype=torch.int32)
        FlashAttentionMetadataBuilder.build = lambda self, *a, **k: SimpleNamespace(
            num_actual_tokens=int(starts[-1]), query_start_loc=starts, seq_lens=case.seq_lens,
            max_query_len=max(query_lens), block_table=case.block_table, causal=True,
            mm_prefix_range_tensor=None)
        builder = object.__new__(fb.MiniPICFlashMetadataBuilder)
        builder.block_size, builder.device = bs, torch.device("cpu")
        builder.split_kv_scratch = tk.split_kv_buffers(64, 4, dim, "cpu")
        builder.seq_threshold_3d = 8
        builder.use_flash_rows = True  # FlashAttention's default: quiet keys take the kernel
        fb.current_layout = lambda num_reqs, block_size, max_seq_len, decoding: layout
        return builder.build(0, SimpleNamespace(num_reqs=len(markers), query_start_loc=starts,
                                                query_start_loc_cpu=starts,
                                                seq_lens=case.seq_lens,
                                                max_seq_len=max(seq_lens)))

    # Every key written as the steps that computed them would, each K as the model's
    # RoPE hands it (rotated at its index): one write of all tokens of both requests.
    k_raw = [case.k_model[case.block_table[i, torch.arange(n) // bs].long(), torch.arange(n) % bs]
             for i, n in enumerate(seq_lens)]
    stored = {}
    FlashAttentionImpl.do_kv_cache_update = (
        lambda self, layer, key, value, kv_cache, slot_mapping: stored.update(key=key))
    md = build(seq_lens)
    assert md.minipic_quiet_bits is not None
    fb.batch_metadata = lambda layer: md
    impl = _flash_impl(fb, dim, case.scale)
    impl.do_kv_cache_update(None, torch.cat([
        rotate(k, torch.arange(k.shape[0]), case.cos_sin, case.rotary_dim, case.is_neox)
        for k in k_raw]), None, None, None)
    k_cache = case.k_cache.clone()
    whole = [0, *torch.tensor(seq_lens).cumsum(0).tolist()]
    for i, n in enumerate(seq_lens):
        rows = stored["key"][whole[i]: whole[i + 1]]
        k_cache[case.block_table[i, torch.arange(n) // bs].long(), torch.arange(n) % bs] = rows

    md = build(case.query_lens)  # this step's queries
    q_raw = torch.randn(case.q.shape, generator=torch.Generator().manual_seed(5))
    physical = torch.cat([torch.arange(c, c + q) for q, c in zip(case.query_lens,
                                                                   case.context_lens)])
    query = rotate(q_raw, physical, case.cos_sin, case.rotary_dim, case.is_neox)  # the model's Q
    out = torch.full_like(query, float("nan"))
    impl.forward(None, query, None, None, torch.stack((k_cache, case.v_cache), dim=1), md, out)

    logical = [layout.logical[i, :n] for i, n in enumerate(seq_lens)]
    return relative_error(out, _logical_reference(case, layout, q_raw, k_raw, logical))


@pytest.fixture(scope="module")
def interpreter_errors() -> dict[str, float]:
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None:
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    groups = [list(CASES), [*BACKEND_CASES, BACKEND_LINK_CASE, BACKEND_QUIET_CASE]]
    children = [subprocess.Popen([sys.executable, __file__, *group], env=env, cwd=REPO,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for group in groups]
    results: dict[str, float | str] = {}
    for child in children:
        out, err = child.communicate(timeout=900)
        assert child.returncode == 0, err[-4000:]
        results.update(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_matches_reference(interpreter_errors, name):
    dtype = CASES[name][0].get("dtype", "float16")
    err = interpreter_errors[name]
    assert isinstance(err, float), err  # the child reports an exception as text
    assert err < TOLERANCE[dtype], f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("name", [*BACKEND_CASES, BACKEND_LINK_CASE, BACKEND_QUIET_CASE])
def test_backend_forward_matches_reference(interpreter_errors, name):
    err = interpreter_errors[name]
    if isinstance(err, str) and err.startswith("skipped"):
        pytest.skip(err)
    assert isinstance(err, float), err
    assert err < TOLERANCE["float16"], f"{name}: relative error {err:.2e}"


def test_short_queries_launch_prefill_q_blocks():
    """An ISPS step of final prompts (32-token queries, 4 query heads a KV head) launches
    q-blocks that hold a whole query: each request's keys are read and turned once a KV
    head, not once every 4 tokens (DECODE_2D's q-blocks: 12.7x FA3 on that step)."""
    pytest.importorskip("triton")
    from minipic.attention import triton_kernel as tk

    assert tk.choose_config(32, False, 128) is tk.PREFILL
    assert tk.PREFILL.block_m // 4 >= 32
    assert tk.choose_config(1, False, 128) is tk.DECODE_2D


def _run(case_name: str) -> float | str:
    if case_name in CASES:
        return _run_case(case_name)
    if case_name in BACKEND_CASES:
        return _run_backend_forward(case_name)
    if case_name == BACKEND_LINK_CASE:
        return _run_backend_links()
    assert case_name == BACKEND_QUIET_CASE, case_name
    return _run_backend_mask_markers()


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest (sets TRITON_INTERPRET=1)"
    results: dict[str, float | str] = {}
    for case_name in sys.argv[1:]:
        try:
            results[case_name] = _run(case_name)
        except Exception as exc:  # report, so the other cases still run
            results[case_name] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(results))
