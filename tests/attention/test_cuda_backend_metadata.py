"""minipic's CUDA metadata builders: what each batch hands attention (CPU, no kernel).

The kernel itself is checked under the interpreter (test_triton_kernel_interpreter.py);
here, what the builders add to FlashAttention's and Triton's metadata: a batch without
markers gets nothing (the stock backend runs it, and writes K as the model rotated
it); a batch with spans and links gets its tables, per-token link shifts for Q, and
per-token K turn-backs into the keys' frames.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder  # noqa: E402
from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder  # noqa: E402

from minipic.attention import cuda_backend as fb  # noqa: E402
from minipic.attention import rope as rope_registry  # noqa: E402
from minipic.attention.plan_groups import MIN_COPY_LIMIT  # noqa: E402
from minipic.attention.rotation import Rotation  # noqa: E402
from minipic.devtools.paged_attention_case import marker_layout, rope_table  # noqa: E402

BLOCK = 16
MAX_BLOCKS = 12


ROTARY_DIM = 8


@pytest.fixture(autouse=True)
def rope():
    """The model's rotary embedding, as a loaded model registers it."""
    rope_registry.reset_rope()
    rope_registry._register(rope_registry.RopeParams(
        head_size=ROTARY_DIM, rotary_dim=ROTARY_DIM, is_neox_style=True,
        cos_sin_fp32=rope_table(ROTARY_DIM, MAX_BLOCKS * BLOCK)))
    yield
    rope_registry.reset_rope()


def turns(amounts: list[int]):
    """The rotation turning tokens back by `amounts`, as the builder should hand it."""
    return Rotation.back(torch.tensor(amounts), rope_table(ROTARY_DIM, MAX_BLOCKS * BLOCK),
                         ROTARY_DIM, True)


def same_turns(rotation, amounts: list[int]) -> bool:
    expected = turns(amounts)
    return torch.equal(rotation.cos, expected.cos) and torch.equal(rotation.sin, expected.sin)


def new_builder(monkeypatch, kind: str):
    """A builder past vLLM's own part: build() on a stub metadata. `kind`: "flash" (span
    batches as FlashAttention rows), "flash_kernel" (FlashAttention with the option
    span_attention="triton") or "triton"."""
    stock, ours = {"flash": (FlashAttentionMetadataBuilder, fb.MiniPICFlashMetadataBuilder),
                   "flash_kernel": (FlashAttentionMetadataBuilder, fb.MiniPICFlashMetadataBuilder),
                   "triton": (TritonAttentionMetadataBuilder, fb.MiniPICTritonMetadataBuilder)
                   }[kind]
    monkeypatch.setattr(stock, "build", lambda self, *args, **kwargs: SimpleNamespace())
    built = object.__new__(ours)
    built.block_size, built.device = BLOCK, torch.device("cpu")
    built.split_kv_scratch, built.seq_threshold_3d = ("scratch",), 8
    built.use_flash_rows = kind == "flash"  # __init__ would add: FA3 and the option
    built.row_copy_limit = MIN_COPY_LIMIT
    return built


@pytest.fixture(params=["flash", "flash_kernel", "triton"])
def builder(monkeypatch, request):
    return new_builder(monkeypatch, request.param)


@pytest.fixture(params=["flash_kernel", "triton"])
def kernel_builder(monkeypatch, request):
    return new_builder(monkeypatch, request.param)


def build(builder, monkeypatch, markers: list[str], query_lens: list[int], seq_lens: list[int]):
    def layout_of_batch(num_reqs, block_size, max_seq_len, decoding):
        assert max_seq_len == max(seq_lens)  # the layout covers the batch's sequences
        # span ids for the rows whose query is one token (span_layout.current_layout)
        assert decoding.tolist() == [n == 1 for n in query_lens]
        return marker_layout(markers, MAX_BLOCKS, BLOCK)

    monkeypatch.setattr(fb, "current_layout", layout_of_batch)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    common = SimpleNamespace(num_reqs=len(seq_lens), query_start_loc=starts,
                             num_actual_tokens=int(starts[-1]),
                             query_start_loc_cpu=starts,
                             block_table_tensor=torch.arange(len(seq_lens) * MAX_BLOCKS,
                                                             dtype=torch.int32
                                                             ).view(len(seq_lens), MAX_BLOCKS),
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                             max_seq_len=max(seq_lens))
    return builder.build(0, common)


def test_plain_batches_are_left_to_the_stock_backend(builder, monkeypatch):
    md = build(builder, monkeypatch, ["", ""], [5, 1], [40, 17])
    assert md.minipic_tables is None and md.minipic_rows is None
    assert md.minipic_token_shift is None and md.minipic_key_turn is None


def test_a_link_batch_gets_its_tables_shifts_and_key_turns(kernel_builder, monkeypatch):
    markers = ["-S-S-LLP", "-SLP"]
    md = build(kernel_builder, monkeypatch, markers, [42, 3], [122, 43])
    assert md.minipic_rows is None
    layout = marker_layout(markers, MAX_BLOCKS, BLOCK)
    assert torch.equal(md.minipic_tables.span_of, layout.span_of)
    assert torch.equal(md.minipic_tables.context_pos, layout.context_pos)
    # links end after blocks 6 and 2; two link blocks and one
    assert md.minipic_tables.links_end.tolist() == [7 * BLOCK, 3 * BLOCK]
    assert md.minipic_tables.link_tokens.tolist() == [2 * BLOCK, BLOCK]
    # spans' keys relative to their SSep block; keys past the links at logical positions
    assert md.minipic_tables.frame_offset[0, :8].tolist() == [0, BLOCK, BLOCK, 3 * BLOCK,
                                                             3 * BLOCK, 0, 0, 2 * BLOCK]
    # Q: request 0's 42 new tokens are link 1 (shift 4 blocks), link 2 (3 blocks) and the
    # task; request 1's 3 sit in its link (1 block back)
    assert same_turns(md.minipic_token_shift,
                      [4 * BLOCK] * 16 + [3 * BLOCK] * 16 + [0] * 10 + [BLOCK] * 3)
    # K: the same, and the task past the links at its logical position (two link blocks)
    assert same_turns(md.minipic_key_turn,
                      [4 * BLOCK] * 16 + [3 * BLOCK] * 16 + [2 * BLOCK] * 10 + [BLOCK] * 3)
    assert md.minipic_split_kv_scratch == ("scratch",) and md.minipic_seq_threshold_3d == 8


def test_flash_attention_gets_a_link_batch_as_rows(monkeypatch):
    """The default on FlashAttention: the batch's segment plan (no kernel tables) with the
    link tokens' Q shifts in its turns, and the same K turns as the kernel path."""
    from minipic.attention.segment_plan import segment_plan

    markers = ["-S-S-LLP", "-SLP"]
    md = build(new_builder(monkeypatch, "flash"), monkeypatch, markers, [42, 3], [122, 43])
    assert md.minipic_tables is None
    expected = segment_plan(marker_layout(markers, MAX_BLOCKS, BLOCK), [0, 42, 45], [122, 43],
                            BLOCK, link_shifts=True)
    plan = md.minipic_rows.plan
    for got, want in ((plan.own, expected.own), (plan.earlier, expected.earlier)):
        assert torch.equal(got.row_blocks, want.row_blocks)
        assert torch.equal(got.query_turn, want.query_turn)
    # short runs: one call (the causal rows as rows of one query each, see segment_plan)
    assert plan.joint is not None and md.minipic_rows.own_table is None
    # the rows' physical blocks: request r's logical block b is r * MAX_BLOCKS + b here
    joint = plan.joint
    assert torch.equal(md.minipic_rows.joint_table,
                       (joint.row_request[:, None] * MAX_BLOCKS + joint.row_blocks).int())
    # link 1's queries: shift 4 blocks, in their own frame (turn 0): 64 in all
    assert plan.own.query_turn[:16].tolist() == [4 * BLOCK] * 16
    assert md.minipic_token_shift is None
    assert same_turns(md.minipic_key_turn,
                      [4 * BLOCK] * 16 + [3 * BLOCK] * 16 + [2 * BLOCK] * 10 + [BLOCK] * 3)


AUTO_CASES = {  # name: (markers, query lens, seq lens, whether the span kernel takes it)
    "a_span_hits_question": (["-S-S-P"], [20], [84], True),
    "with_decodes_beside": (["-S-P", "-S-P", "-S-P"], [20, 1, 1], [56, 49, 50], True),
    "at_the_limit": (["-S-S-PPPPPP"], [fb.KERNEL_MAX_QUERY_TOKENS], [180], True),
    "past_the_limit": (["-S-S-PPPPPP"], [fb.KERNEL_MAX_QUERY_TOKENS + 1], [181], False),
    "decodes_only": (["-S-P", "-S-P"], [1, 1], [49, 50], False),
    "with_links": (["-SLP"], [20], [52], False),
}


@pytest.mark.parametrize("name", AUTO_CASES)
def test_auto_sends_short_span_prefills_to_the_kernel(monkeypatch, name):
    """span_attention "auto": a batch of few query tokens with a prefill among them and no
    links (a span hit's question) takes the span kernel (its tables, no plan); the others
    the FlashAttention rows, as under "flash"."""
    markers, query_lens, seq_lens, on_kernel = AUTO_CASES[name]
    builder = new_builder(monkeypatch, "flash")
    builder.short_prefills_on_kernel = True
    md = build(builder, monkeypatch, markers, query_lens, seq_lens)
    assert (md.minipic_tables is not None) == on_kernel
    assert (md.minipic_rows is None) == on_kernel
    rows = build(new_builder(monkeypatch, "flash"), monkeypatch, markers, query_lens, seq_lens)
    assert rows.minipic_rows is not None and rows.minipic_tables is None


@pytest.mark.parametrize("graphs, capture, tokens", [
    ("NONE", 512, 0),  # enforce_eager: every batch eager
    ("FULL_DECODE_ONLY", 512, 0),  # prefills and mixed batches run eagerly
    ("FULL_AND_PIECEWISE", 512, 512),  # vLLM's default
    ("PIECEWISE", 8, 8),
    ("FULL", 256, 256),
])
def test_prefills_replay_graphs_up_to_the_largest_capture_size(graphs, capture, tokens):
    from vllm.config import CUDAGraphMode

    config = SimpleNamespace(compilation_config=SimpleNamespace(
        cudagraph_mode=CUDAGraphMode[graphs], max_cudagraph_capture_size=capture))
    assert fb.graph_prefill_tokens(config) == tokens


@pytest.mark.parametrize("graph_tokens, on_kernel", [
    (0, True),  # eager: the question's step is host-bound
    (19, True),  # more tokens than any captured size: run eagerly
    (20, False),  # replayed as a graph: the GPU's time counts, the rows
    (512, False),
])
def test_auto_keeps_a_graphed_question_on_the_rows(monkeypatch, graph_tokens, on_kernel):
    """span_attention "auto" under CUDA graphs: a short span prefill that replays piecewise
    graphs takes the rows (the GPU's time counts there, and the kernel's is 3.1-4.4x FA3's);
    one run eagerly, the kernel."""
    markers, query_lens, seq_lens, _ = AUTO_CASES["a_span_hits_question"]
    builder = new_builder(monkeypatch, "flash")
    builder.short_prefills_on_kernel = True
    builder.graph_tokens = graph_tokens
    md = build(builder, monkeypatch, markers, query_lens, seq_lens)
    assert (md.minipic_tables is not None) == on_kernel
    assert (md.minipic_rows is None) == on_kernel


def test_the_span_plan_runs_in_one_torch_thread(monkeypatch):
    """Torch's thread pool stays out of the host planning (its threads would busy-wait
    beside the step's thread after each small op), and is left as it was."""
    recorded = []

    def plan(*args, **kwargs):
        recorded.append(torch.get_num_threads())
        return segment_plan(*args, **kwargs)

    from minipic.attention.segment_plan import segment_plan

    monkeypatch.setattr(fb, "segment_plan", plan)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        md = build(new_builder(monkeypatch, "flash"), monkeypatch, ["-S-S-LLP", "-SLP"],
                   [42, 3], [122, 43])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert md.minipic_rows is not None and recorded == [1]


def test_rows_follow_another_kv_cache_groups_block_table(monkeypatch):
    markers = ["-S-S-LLP", "-SLP"]
    builder = new_builder(monkeypatch, "flash")
    md = build(builder, monkeypatch, markers, [42, 3], [122, 43])
    monkeypatch.setattr(FlashAttentionMetadataBuilder, "update_block_table",
                        lambda self, metadata, blk_table, slot_mapping: SimpleNamespace(
                            block_table=blk_table))
    other = torch.arange(2 * MAX_BLOCKS, dtype=torch.int32).view(2, MAX_BLOCKS) + 1000
    new = builder.update_block_table(md, other, None)
    joint = new.minipic_rows.plan.joint  # short runs: one call (see the test above)
    assert torch.equal(new.minipic_rows.joint_table,
                       other[joint.row_request[:, None], joint.row_blocks])
    assert not torch.equal(new.minipic_rows.joint_table, md.minipic_rows.joint_table)


def test_another_kv_cache_group_binds_its_own_kernel_launches(monkeypatch):
    """vLLM copies one group's metadata for another (copy.copy): the span kernel's launch
    cache must not be shared, or layers of two groups would bind again by turns."""
    import copy

    builder = new_builder(monkeypatch, "flash_kernel")
    md = build(builder, monkeypatch, ["-S-S-LLP"], [42], [122])
    monkeypatch.setattr(FlashAttentionMetadataBuilder, "update_block_table",
                        lambda self, metadata, blk_table, slot_mapping: copy.copy(metadata))
    md.minipic_launches["attention"] = "bound by the first group's first layer"
    md.minipic_kernel_args = {"block_table": "the first group's"}  # made at that layer
    new = builder.update_block_table(md, torch.zeros(1, MAX_BLOCKS, dtype=torch.int32), None)
    assert new.minipic_launches == {} and new.minipic_launches is not md.minipic_launches
    assert new.minipic_kernel_args is None  # made again, on this group's block table


def test_rows_past_the_copy_limit_go_in_groups_of_query_tokens(monkeypatch):
    """Each non-causal row copies its run's queries: past the builder's row_copy_limit the
    batch is planned in groups of query tokens that stay within it (plan_groups.py), each
    over its requests' rows of the block table; a request that alone copies more is cut.
    None takes the kernel."""
    from minipic.attention.plan_groups import earlier_copies
    from minipic.attention.segment_attention import GroupedBatch
    from minipic.attention.segment_plan import segment_plan

    markers, query_lens, seq_lens = ["-S-S-LLP", "-S-P"], [42, 5], [122, 64]
    plan = segment_plan(marker_layout(markers, MAX_BLOCKS, BLOCK), [0, 42, 47], seq_lens,
                        BLOCK, link_shifts=True)
    first = int((plan.earlier.query_index < 42).sum())  # request 0's copies
    assert 0 < first < earlier_copies(plan)
    builder = new_builder(monkeypatch, "flash")
    builder.row_copy_limit = earlier_copies(plan)  # at the limit: one plan
    md = build(builder, monkeypatch, markers, query_lens, seq_lens)
    assert not isinstance(md.minipic_rows, GroupedBatch) and md.minipic_rows is not None
    for limit, extents in ((first, [(0, 1, 0, 42), (1, 2, 42, 47)]),
                           (first - 1, [(0, 1, 0, 41), (0, 2, 41, 47)])):
        builder.row_copy_limit = limit
        md = build(builder, monkeypatch, markers, query_lens, seq_lens)
        assert isinstance(md.minipic_rows, GroupedBatch) and md.minipic_tables is None
        assert [(g.first_request, g.end_request, g.first_token, g.end_token)
                for g in md.minipic_rows.groups] == extents
        last = md.minipic_rows.batches[-1]
        rows = last.plan.joint
        assert torch.equal(last.joint_table,  # the block table's rows of its requests
                           ((extents[-1][0] + rows.row_request[:, None]) * MAX_BLOCKS
                            + rows.row_blocks).int())
        assert md.minipic_token_shift is None and md.minipic_key_turn is not None


def test_mask_markers_batches_take_the_kernel_on_flash_attention(monkeypatch):
    """Quiet keys are single keys: FlashAttention rows cannot hide them, the kernel does."""
    from minipic.attention.span_layout import take_no_room

    def quiet_layout(num_reqs, block_size, max_seq_len, decoding):
        layout = marker_layout(["-S-P"], MAX_BLOCKS, BLOCK)
        quiet = torch.zeros(1, MAX_BLOCKS * BLOCK, dtype=torch.bool)
        quiet[0, [BLOCK, 3 * BLOCK]] = True
        take_no_room(layout, quiet, BLOCK)
        return layout

    monkeypatch.setattr(fb, "current_layout", quiet_layout)
    builder = new_builder(monkeypatch, "flash")
    starts = torch.tensor([0, 20], dtype=torch.int32)
    common = SimpleNamespace(num_reqs=1, query_start_loc=starts, query_start_loc_cpu=starts,
                             num_actual_tokens=20,
                             block_table_tensor=torch.zeros(1, MAX_BLOCKS, dtype=torch.int32),
                             seq_lens=torch.tensor([64], dtype=torch.int32), max_seq_len=64)
    md = builder.build(0, common)
    assert md.minipic_rows is None and md.minipic_tables is not None
    assert md.minipic_quiet_bits is not None


def test_spans_without_links_turn_span_keys_only(builder, monkeypatch):
    md = build(builder, monkeypatch, ["-S-P"], [64], [64])
    assert md.minipic_token_shift is None
    assert same_turns(md.minipic_key_turn, [0] * 16 + [BLOCK] * 32 + [0] * 16)


def test_quiet_keys_reach_the_kernel_as_bits():
    """mask_markers: a word per 32 keys, bit 31 included (int32's sign bit)."""
    from minipic.attention.triton_kernel import quiet_words

    quiet = torch.zeros(2, 100, dtype=torch.bool)
    quiet[0, [0, 31, 32, 70]] = True
    quiet[1, 99] = True  # past num_keys: not sent
    words = quiet_words(quiet, 80)
    assert words.dtype == torch.int32 and words.shape == (2, 3)
    unpacked = [[k for k in range(96) if int(words[r, k // 32]) >> (k % 32) & 1] for r in (0, 1)]
    assert unpacked == [[0, 31, 32, 70], []]


@pytest.mark.parametrize("mask_markers", [False, True])
def test_every_layer_launches_the_kernel_on_the_same_arguments(monkeypatch, mask_markers):
    """The span kernel's launches stay bound from layer to layer only if each layer hands
    them the same table objects (segment_kernels.RepeatedLaunch compares them by identity):
    the arguments are made once a batch, mask_markers' link-free tables included."""
    from minipic.attention.triton_kernel import quiet_words

    calls = []
    monkeypatch.setattr(fb, "unified_attention_rope",
                        lambda q, k, v, out, **kwargs: calls.append(kwargs))
    layout = marker_layout(["-S-P"], MAX_BLOCKS, BLOCK)
    quiet = quiet_words(torch.zeros(1, 64, dtype=torch.bool), 64) if mask_markers else None
    md = SimpleNamespace(
        causal=True, mm_prefix_range_tensor=None, num_actual_tokens=4, minipic_rows=None,
        minipic_tables=layout, minipic_quiet_bits=quiet, minipic_token_shift=None,
        minipic_span_block_size=BLOCK, minipic_split_kv_scratch=(None, None, None),
        query_start_loc=torch.tensor([0, 4]), seq_lens=torch.tensor([64]), max_query_len=4,
        block_table=torch.zeros(1, MAX_BLOCKS, dtype=torch.int32),
        minipic_seq_threshold_3d=8, minipic_launches={}, minipic_kernel_args=None)
    impl = object.__new__(fb.MiniPICFlashImpl)
    impl.head_size, impl.scale, impl._cos_sin = ROTARY_DIM, 1.0, None
    query = torch.zeros(4, 2, ROTARY_DIM)
    kv_cache = torch.zeros(MAX_BLOCKS, 2, BLOCK, 1, ROTARY_DIM)
    for _layer in range(3):
        impl.forward(None, query, None, None, kv_cache, md, torch.zeros_like(query))
    assert len(calls) == 3 and set(calls[0]) == set(calls[2])
    for name, first in calls[0].items():
        assert all(call[name] is first for call in calls[1:]), name
