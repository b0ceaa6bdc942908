"""The torch position-free backend equals attention over keys rotated by vLLM's own RoPE.

The reference rotates Q and K with vLLM's stock `forward_static` (as stock vLLM
does) and attends by the span rule; minipic's backend gets the same rotated Q and K,
stores K in its frame (span_layout.SpanLayout.frame_offset) and must produce the same
output.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

BLOCK_SIZE = 32
NUM_BLOCKS = 16
# (cached prefix length, new query tokens) per request: prefill, decode, chunked prefill
MIXED_BATCH = [(0, 40), (70, 1), (33, 17), (0, 1)]


@pytest.fixture(autouse=True)
def vllm_config_context():
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


def make_rope(kind: str, head_size: int, rotary_dim: int, is_neox: bool):
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.model_executor.layers.rotary_embedding.llama3_rope import Llama3RotaryEmbedding

    args = (head_size, rotary_dim, 4096, 10000.0, is_neox, torch.float32)
    if kind == "llama3":
        return Llama3RotaryEmbedding(*args, scaling_factor=8.0, low_freq_factor=1.0,
                                     high_freq_factor=4.0, orig_max_position=64)
    return RotaryEmbedding(*args)


def stock_rotate(rope, positions, x):
    """vLLM's own rotation of x [tokens, heads, head_size]."""
    n, h, d = x.shape
    out, _ = type(rope).forward_static(positions, x.reshape(n, h * d).clone(), None, d,
                                       rope.rotary_dim, rope.cos_sin_cache, rope.is_neox_style)
    return out.view(n, h, d)


def reference_attention(q_rot, k_rot, v, scale, prefix_len, mask=None):
    group = q_rot.shape[1] // k_rot.shape[1]
    k_rot, v = k_rot.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    t, s = q_rot.shape[0], k_rot.shape[0]
    if mask is None:
        mask = torch.arange(s)[None, :] <= (prefix_len + torch.arange(t))[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q_rot.transpose(0, 1), k_rot.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize("head_size", [64, 80])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5], ids=["full", "partial"])
@pytest.mark.parametrize("rope_kind", ["default", "llama3"])
@pytest.mark.parametrize("markers", [None, ["-S", "-SS", "-S", ""]], ids=["plain", "spans"])
def test_matches_rotated_k_attention(head_size, is_neox, rotary_fraction, rope_kind, markers,
                                     monkeypatch):
    """Plain batches: K stored as the model rotated it, read as it is. Span batches: K
    written in its span's frame and turned forward when read; spans see only themselves
    (the reference applies span_layout.visible_keys, keys at their indices)."""
    from minipic.attention import rope as rope_registry
    from minipic.attention import torch_backend as tb
    from minipic.attention.links import token_turns
    from minipic.attention.span_layout import visible_keys
    from minipic.devtools.paged_attention_case import marker_layout

    torch.manual_seed(0)
    num_heads, num_kv_heads = 8, 2
    rotary_dim = int(head_size * rotary_fraction)
    rope = make_rope(rope_kind, head_size, rotary_dim, is_neox)
    rope_registry.reset_rope()
    rope_registry.register_rope(rope)
    impl = tb.MiniPICTorchImpl(num_heads, head_size, head_size**-0.5, num_kv_heads,
                               None, None, "auto")
    kv_cache = torch.zeros(NUM_BLOCKS, num_kv_heads, BLOCK_SIZE, 2 * head_size)
    # Each request owns scattered, non-contiguous blocks.
    block_table = torch.randperm(NUM_BLOCKS).view(len(MIXED_BATCH), -1)
    seq_lens = [p + n for p, n in MIXED_BATCH]
    layout = None if markers is None else marker_layout(markers, 4, BLOCK_SIZE)

    queries, expected, query_start_loc = [], [], [0]
    for i, (prefix, new) in enumerate(MIXED_BATCH):
        seq_len = prefix + new
        k = torch.randn(seq_len, num_kv_heads, head_size)
        v = torch.randn(seq_len, num_kv_heads, head_size)
        q = torch.randn(new, num_heads, head_size)
        slots = block_table[i, torch.arange(seq_len) // BLOCK_SIZE] * BLOCK_SIZE + torch.arange(seq_len) % BLOCK_SIZE
        q_rot = stock_rotate(rope, torch.arange(prefix, seq_len), q)
        k_rot = stock_rotate(rope, torch.arange(seq_len), k)  # what the model hands attention
        turn = None if layout is None else token_turns(
            layout.frame_offset[i, torch.arange(seq_len) // BLOCK_SIZE], torch.device("cpu"))
        monkeypatch.setattr(tb, "batch_metadata", lambda layer: SimpleNamespace(key_turn=turn))
        impl.do_kv_cache_update(None, k_rot, v, kv_cache, slots)
        queries.append(q_rot)
        mask = None if layout is None else visible_keys(layout, i, seq_len, new, BLOCK_SIZE)
        expected.append(reference_attention(q_rot, k_rot, v, impl.scale, prefix, mask))
        query_start_loc.append(query_start_loc[-1] + new)

    query = torch.cat(queries)
    output = torch.empty_like(query)
    metadata = tb.MiniPICTorchMetadata(
        num_actual_tokens=query.shape[0], query_start_loc=query_start_loc,
        seq_lens=seq_lens, block_table=block_table, block_size=BLOCK_SIZE, layout=layout,
        visible=None if layout is None else [
            visible_keys(layout, i, s, n, BLOCK_SIZE)
            for i, (s, (_, n)) in enumerate(zip(seq_lens, MIXED_BATCH))])
    impl.forward(None, query, None, None, kv_cache, metadata, output)
    torch.testing.assert_close(output, torch.cat(expected), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("rope_kind", ["default", "llama3"])
def test_registered_rope_stays_stock(rope_kind):
    """minipic registers the model's rope and leaves its forward alone: Q and K leave
    it rotated exactly as stock vLLM rotates them (a plain prompt's cache is stock)."""
    from minipic.attention import rope as rope_registry

    rope = make_rope(rope_kind, 64, 64, True)
    rope_registry.reset_rope()
    rope_registry.register_rope(rope)
    positions = torch.arange(5, 45)
    q, k = torch.randn(40, 2 * 64), torch.randn(40, 64)
    q_out, k_out = rope(positions, q.clone(), k.clone())
    torch.testing.assert_close(q_out.view(40, 2, 64), stock_rotate(rope, positions, q.view(40, 2, 64)))
    torch.testing.assert_close(k_out.view(40, 1, 64), stock_rotate(rope, positions, k.view(40, 1, 64)))
    assert torch.equal(rope_registry.current_rope().cos_sin_fp32,
                       rope._compute_cos_sin_cache().float())


def test_cache_update_skips_unkept_slots_anywhere_in_the_batch():
    """A -1 slot in the middle must not shift the later keys into the wrong slots."""
    from minipic.attention.torch_backend import MiniPICTorchImpl, gather_request_kv

    impl = MiniPICTorchImpl(2, 64, 0.125, 1, None, None, "auto")
    kv_cache = torch.zeros(2, 1, BLOCK_SIZE, 128)
    k, v = torch.randn(41, 1, 64), torch.randn(41, 1, 64)
    slots = torch.cat([torch.arange(20), torch.tensor([-1]), torch.arange(20, 40)])
    impl.do_kv_cache_update(None, k, v, kv_cache, slots)
    keep = slots >= 0
    k_read, v_read = gather_request_kv(kv_cache, torch.tensor([0, 1]), 40, 64)
    assert torch.equal(k_read, k[keep]) and torch.equal(v_read, v[keep])


def test_a_rope_over_part_of_each_head_is_refused_at_load():
    from minipic.attention import rope as rope_registry
    from minipic.attention.torch_backend import MiniPICTorchImpl, UnsupportedAttentionError

    rope_registry.reset_rope()
    rope_registry.register_rope(make_rope("default", 32, 32, True))  # 32 of 96 dims
    impl = MiniPICTorchImpl(2, 96, 0.1, 1, None, None, "auto")
    with pytest.raises(UnsupportedAttentionError, match="covers 32 of each head's 96"):
        impl.process_weights_after_loading(torch.float32)
    rope_registry.reset_rope()
    with pytest.raises(rope_registry.UnsupportedRopeError, match="no rotary embedding"):
        impl.process_weights_after_loading(torch.float32)


@pytest.mark.parametrize("feature", ["alibi", "sliding_window", "fp8"])
def test_refuses_unsupported_layer_features(feature):
    from minipic.attention.torch_backend import MiniPICTorchImpl, UnsupportedAttentionError

    kwargs = dict(alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
    kwargs.update({"alibi": {"alibi_slopes": [0.5, 0.25]}, "sliding_window": {"sliding_window": 128},
                   "fp8": {"kv_cache_dtype": "fp8"}}[feature])
    with pytest.raises(UnsupportedAttentionError, match="does not support"):
        MiniPICTorchImpl(2, 64, 0.125, 1, **kwargs)


def test_refuses_rope_with_its_own_position_math():
    from vllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding

    from minipic.attention.rope import UnsupportedRopeError, register_rope

    mrope = MRotaryEmbedding(64, 64, 4096, 10000.0, True, torch.float32, mrope_section=[16, 8, 8])
    with pytest.raises(UnsupportedRopeError, match="MRotaryEmbedding"):
        register_rope(mrope)


def test_a_layer_that_chose_a_stock_backend_is_refused():
    from types import SimpleNamespace

    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from minipic.attention.layer_check import (
        NotPositionFreeError, check_every_layer_is_position_free)
    from minipic.attention.torch_backend import MiniPICTorchBackend

    ours = SimpleNamespace(attn_backend=MiniPICTorchBackend)
    check_every_layer_is_position_free({"layers.0.attn": ours, "layers.0.mlp": SimpleNamespace()})
    stock = SimpleNamespace(attn_backend=CPUAttentionBackend)
    with pytest.raises(NotPositionFreeError, match=r"layers\.1\.attn .*CPUAttentionBackend"):
        check_every_layer_is_position_free({"layers.0.attn": ours, "layers.1.attn": stock})


def test_batched_short_queries_ignore_stale_cache_slots():
    """Requests of different lengths attended together: slots past a request's length
    (never written, or another request's) may hold NaN and must not reach its output;
    the result equals attending to each request alone."""
    from types import SimpleNamespace

    from minipic.attention.torch_backend import (
        MiniPICTorchImpl, MiniPICTorchMetadata, causal_attention, gather_request_kv)

    torch.manual_seed(0)
    heads, kv_heads, d, block = 4, 2, 8, 4
    kv_cache = torch.full((6, kv_heads, block, 2 * d), float("nan"))
    seq_lens, query_lens = [7, 3], [2, 1]
    table = torch.tensor([[0, 1], [2, 3]])
    for row, n in zip(table, seq_lens):  # only the requests' own slots are written
        for pos in range(n):
            kv_cache[row[pos // block], :, pos % block] = torch.randn(kv_heads, 2 * d)
    q_all = torch.randn(sum(query_lens), heads, d)
    md = MiniPICTorchMetadata(num_actual_tokens=3, query_start_loc=[0, 2, 3], seq_lens=seq_lens,
                              block_table=table, block_size=block)
    impl = object.__new__(MiniPICTorchImpl)
    impl.head_size, impl.scale, impl.logits_soft_cap = d, 0.3, 0.0
    rope = SimpleNamespace(rotary_dim=d, is_neox_style=True)
    cos_sin = torch.randn(16, d)
    got = impl._short_queries(q_all, kv_cache, md, [0, 1], rope, cos_sin)
    alone = []
    for i, (start, n) in enumerate(zip([0, 2], query_lens)):
        k, v = gather_request_kv(kv_cache, table[i], seq_lens[i], d)  # plain: K as stored
        alone.append(causal_attention(q_all[start:start + n], k, v, 0.3))
    assert torch.isfinite(got).all()
    assert torch.allclose(got, torch.cat(alone), atol=1e-5)


@pytest.mark.parametrize("mscale", [1.0, 1.3], ids=["plain_table", "mscale_table"])
def test_links_take_no_room_in_both_query_paths(mscale, monkeypatch):
    """EPIC layouts through the torch backend's per-request path (a 42-token link and
    task chunk) and its batched short-query path (two decodes after links, batched with
    a decode without links), against the paged reference: queries past the links see
    every key before them `link_tokens` positions nearer (span_layout.SpanLayout). Link Q
    is taken as already turned back."""
    from minipic.attention import torch_backend as tb
    from minipic.attention.span_layout import visible_keys
    from minipic.devtools.paged_attention_case import make_case, reference_attention

    case = make_case([42, 1, 1, 1], [80, 121, 60, 70], num_q_heads=4, num_kv_heads=2,
                     head_size=16, dtype=torch.float32, block_size=16, mscale=mscale, seed=3,
                     markers=["-S-S-LLP", "-S-S-LLP", "-SLP", "-S-SP"])
    assert case.layout.link_tokens.tolist() == [32, 32, 16, 0]
    kv_cache = torch.cat((case.k_cache, case.v_cache), dim=-1).transpose(1, 2).nan_to_num()
    seq_lens, starts = case.seq_lens.tolist(), case.cu_seqlens_q.tolist()
    md = tb.MiniPICTorchMetadata(
        num_actual_tokens=case.q.shape[0], query_start_loc=starts, seq_lens=seq_lens,
        block_table=case.block_table, block_size=16, layout=case.layout,
        visible=[visible_keys(case.layout, i, n, q, 16)
                 for i, (n, q) in enumerate(zip(seq_lens, case.query_lens))])
    impl = object.__new__(tb.MiniPICTorchImpl)
    impl.num_heads, impl.head_size, impl.scale, impl.logits_soft_cap = 4, 16, case.scale, 0.0
    rope = SimpleNamespace(rotary_dim=16, is_neox_style=True, cos_sin=lambda device: case.cos_sin)
    monkeypatch.setattr(tb, "current_rope", lambda: rope)
    out = torch.empty_like(case.q)
    impl.forward(None, case.q, None, None, kv_cache, md, out)
    assert torch.allclose(out.double(), reference_attention(case), atol=1e-5)
