"""The CUDA backend's cache write for span batches (CPU, no kernel): a batch attended by
FlashAttention rows leaves its write to forward, which turns the new keys in the queries'
launch and writes them before any row reads the cache; other batches write at once.

The rows run through `paged_flash_reference` (what FlashAttention computes) and the turns
and merge through their torch versions, so MiniPICFlashImpl's own code is what is tested.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl  # noqa: E402

from minipic.attention import cuda_backend as fb  # noqa: E402
from minipic.attention import rope as rope_registry  # noqa: E402
from minipic.attention.links import token_turns  # noqa: E402
from minipic.attention.rotation import Rotation  # noqa: E402
from minipic.attention.plan_groups import group_plans, token_groups  # noqa: E402
from minipic.attention.segment_attention import (GroupedBatch, paged_flash_reference,  # noqa: E402
                                                 prepare, prepare_groups)
from minipic.attention.segment_plan import segment_plan  # noqa: E402
from minipic.attention.span_layout import key_turn_backs, token_shifts  # noqa: E402
from minipic.devtools.paged_attention_case import (epic_markers, make_case,  # noqa: E402
                                                   reference_attention, relative_error)

PADDING = 3  # tokens past the batch's, as a padded CUDA graph batch has them (no slot)


@pytest.fixture(autouse=True)
def no_rope_left():
    yield
    rope_registry.reset_rope()


@pytest.fixture
def writes(monkeypatch):
    """The stock cache writes, recorded and done (keys scattered by their slots)."""
    done = []

    def write(self, layer, key, value, kv_cache, slot_mapping):
        done.append(SimpleNamespace(key=key, value=value, slots=slot_mapping))
        kept = slot_mapping[slot_mapping >= 0]
        block_size = kv_cache.shape[2]
        kv_cache[kept // block_size, 0, kept % block_size] = key[slot_mapping >= 0]

    monkeypatch.setattr(FlashAttentionImpl, "do_kv_cache_update", write)
    return done


def epic_batch():
    """An EPIC hit and decodes (links and a task past them: their keys turn), with the
    model's Q and K as it hands them (each token rotated at its index), and the stored
    frames' keys taken out of the cache."""
    case = make_case([160 + 40, 1, 1, 7], [16 + 640, 800, 16 + 288 + 96 + 50, 20],
                     markers=[epic_markers(10, 4, 1, 3), epic_markers(3, 12, 2, 8),
                              epic_markers(3, 6, 2, 5), ""],
                     num_q_heads=6, num_kv_heads=2, head_size=32, dtype=torch.float32)
    rope_registry.reset_rope()  # the model's rotary embedding, as a loaded model registers it
    rope_registry._register(rope_registry.RopeParams(
        head_size=32, rotary_dim=case.rotary_dim, is_neox_style=case.is_neox,
        cos_sin_fp32=case.cos_sin))
    # One cache [blocks, 2, block, heads, dim] (vLLM 0.25's), the case's K and V views of it.
    kv_cache = torch.stack((case.k_cache, case.v_cache), dim=1)
    case.k_cache, case.v_cache = kv_cache.unbind(1)
    qsl, seq_lens = case.cu_seqlens_q.tolist(), case.seq_lens.tolist()
    block, offset = case.query_slots()
    turn = key_turn_backs(case.layout, qsl, seq_lens, 16)
    frames_k = case.k_cache[block, offset].clone()
    model_k = Rotation.at(turn, case.cos_sin, case.rotary_dim, case.is_neox,
                          pure=True).apply(frames_k)
    shifts = token_shifts(case.layout, qsl, seq_lens, 16)
    model_q = Rotation.at(shifts, case.cos_sin, case.rotary_dim, case.is_neox,
                          pure=True).apply(case.q)
    case.k_cache[block, offset] = float("nan")  # read before the write: NaN out
    n = block.numel()
    pad = torch.full((PADDING,), -1, dtype=torch.long)  # vLLM's slot of a padding token
    return SimpleNamespace(
        case=case, slots=torch.cat([block * 16 + offset, pad]), frames_k=frames_k, n=n,
        key=torch.cat([model_k, torch.randn(PADDING, *model_k.shape[1:])]),
        value=torch.cat([case.v_cache[block, offset], torch.randn(PADDING, 2, 32)]),
        query=model_q, kv_cache=kv_cache,
        key_turn=token_turns(turn, torch.device("cpu")))


def rows_metadata(batch, groups_of: int | None = None):
    """The batch's metadata on the rows path: one plan, or (`groups_of`) token groups of
    at most that many query copies."""
    case = batch.case
    qsl, seq_lens = case.cu_seqlens_q.tolist(), case.seq_lens.tolist()
    plan = segment_plan(case.layout, qsl, seq_lens, 16, link_shifts=True)
    rope = (case.block_table, case.cos_sin, case.rotary_dim, case.is_neox)
    if groups_of is None:
        rows = prepare(plan, *rope)
    else:
        rows = prepare_groups(group_plans(case.layout, qsl, seq_lens, 16,
                                          token_groups(plan, qsl, groups_of),
                                          link_shifts=True), *rope)
    return SimpleNamespace(
        num_actual_tokens=batch.n, causal=True, mm_prefix_range_tensor=None,
        minipic_tables=None, minipic_key_turn=batch.key_turn, minipic_rows=rows)


def flash_impl(case):
    """A MiniPICFlashImpl with what its rows path reads (FlashAttention's own __init__
    looks for a FlashAttention build, which the CPU has not); its rows on the reference."""
    impl = object.__new__(fb.MiniPICFlashImpl)
    impl.num_heads, impl.head_size, impl.scale = 6, 32, case.scale
    impl._cos_sin, impl._deferred_write = None, None
    impl.run_flash_rows = functools.partial(paged_flash_reference, scale=case.scale)
    return impl


@pytest.mark.parametrize("groups_of", [None, 100], ids=["one_plan", "token_groups"])
def test_a_rows_batch_writes_its_turned_keys_in_forward(monkeypatch, writes, groups_of):
    """Once, before any row reads the cache: in groups (plan_groups.py), by the first."""
    batch = epic_batch()
    md = rows_metadata(batch, groups_of)
    if groups_of is not None:
        assert isinstance(md.minipic_rows, GroupedBatch) and len(md.minipic_rows.groups) > 2
    monkeypatch.setattr(fb, "batch_metadata", lambda layer: md)
    impl = flash_impl(batch.case)
    impl.do_kv_cache_update(None, batch.key, batch.value, batch.kv_cache, batch.slots)
    assert writes == []  # left to forward
    out = torch.full_like(batch.query, float("nan"))
    impl.forward(None, batch.query, batch.key, batch.value, batch.kv_cache, md, out)
    [write] = writes
    assert torch.equal(write.slots, batch.slots[: batch.n])  # the padding has no slot
    assert torch.equal(write.value, batch.value[: batch.n])
    assert relative_error(write.key, batch.frames_k) < 1e-5  # in their frames
    assert relative_error(out, reference_attention(batch.case)) < 1e-5
    assert impl._deferred_write is None


def test_a_kernel_batch_writes_its_turned_keys_at_once(monkeypatch, writes):
    """Without rows (the span kernel's batches) the write is not left to forward."""
    batch = epic_batch()
    md = rows_metadata(batch)
    md.minipic_rows = None
    monkeypatch.setattr(fb, "batch_metadata", lambda layer: md)
    impl = flash_impl(batch.case)
    impl.do_kv_cache_update(None, batch.key, batch.value, batch.kv_cache, batch.slots)
    [write] = writes
    assert relative_error(write.key[: batch.n], batch.frames_k) < 1e-5
    assert impl._deferred_write is None


def test_a_write_forward_never_took_is_not_done_later(monkeypatch, writes):
    """A deferred write whose forward did not run (it raised) is dropped by the next
    layer call's write, not done later with another batch's keys and slots."""
    batch = epic_batch()
    md = rows_metadata(batch)
    monkeypatch.setattr(fb, "batch_metadata", lambda layer: md)
    impl = flash_impl(batch.case)
    impl.do_kv_cache_update(None, batch.key, batch.value, batch.kv_cache, batch.slots)
    plain = SimpleNamespace(minipic_rows=None, minipic_key_turn=None)
    monkeypatch.setattr(fb, "batch_metadata", lambda layer: plain)
    impl.do_kv_cache_update(None, batch.key, batch.value, batch.kv_cache, batch.slots)
    assert len(writes) == 1 and impl._deferred_write is None
