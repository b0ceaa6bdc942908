"""Which keys a query may see, from the marker blocks of its request."""

import pytest
import torch

from minipic.attention.span_layout import HIDDEN, span_layout, visible_keys
from minipic.protocol import SpanProtocol

P = SpanProtocol(ssep_token_id=3, pdep_token_id=4, pad_token_id=5, link_token_id=6)


def layout(*rows, block_size=32, prompt_lens=None):
    return span_layout(torch.tensor(rows), P, block_size, prompt_lens)


def first_key_table(found, block_size):
    """[reqs, blocks] first key each block's queries see (the span rule without links)."""
    return torch.where(found.span_of >= 0, found.span_of * block_size, 0).tolist()


def table(*rows, block_size=32):
    return first_key_table(layout(*rows, block_size=block_size), block_size)


def test_no_markers_sees_everything():
    assert table([10, 11, 12]) == [[0, 0, 0]]
    assert layout([10, 11, 12]).is_plain()


def test_a_span_at_the_prompt_start_is_stock_attention_and_any_other_is_not():
    # a span prefilled alone, then its task: every query sees every key before it
    assert layout([3, 9, 4]).is_plain()
    assert layout([3, 9, 4]).frame_offset.tolist() == [[0, 0, 0]]
    # a second span sees only itself, stored relative to its start
    spans = layout([3, 9, 3, 9])
    assert not spans.is_plain() and spans.frame_offset.tolist() == [[0, 0, 64, 64]]
    assert not layout([1, 3, 9]).is_plain()  # after a header


def test_frames_of_links_and_the_task_after_them():
    # header, span 1 (blocks 1-2), span 2 (3-5), link 1, link 2 (2 blocks), PDep task
    found = layout([1, 3, 9, 3, 9, 9, 6, 6, 9, 4], block_size=16)
    # spans relative to their SSep blocks, links at 0 (turned back by their shifts),
    # the task at its logical position (48 link tokens back)
    assert found.frame_offset.tolist() == [[0, 16, 16, 48, 48, 48, 0, 0, 0, 48]]


def test_ssep_segments_and_pdep_reset():
    # blocks: header, SSep span (2 blocks), SSep span, PDep task, generated
    assert table([1, 3, 50, 3, 4, 60]) == [[0, 32, 32, 96, 0, 0]]


def test_rows_are_independent_and_span_at_block_zero():
    assert table([3, 7, 3], [7, 7, 3], block_size=16) == [[0, 0, 32], [0, 0, 32]]


def test_markers_in_generated_tokens_are_ignored():
    firsts = torch.tensor([[1, 3, 50, 3]])  # the second SSep is a generated token
    found = span_layout(firsts, P, 32, prompt_lens=torch.tensor([96]))
    assert first_key_table(found, 32) == [[0, 32, 32, 32]]


def test_links_carry_their_spans_heads():
    # header, span 1 (blocks 1-2), span 2 (3-5), link 1, link 2 (2 blocks), PDep task
    found = layout([1, 3, 9, 3, 9, 9, 6, 6, 9, 4], block_size=16)
    assert found.span_of.tolist() == [[-1, 1, 1, 3, 3, 3, -1, -1, -1, -1]]
    # links take the positions of the blocks they carry; those blocks are hidden
    assert found.context_pos.tolist() == [[0, HIDDEN, 32, HIDDEN, HIDDEN, 80,
                                           16, 48, 64, 144]]
    assert found.shift.tolist() == [[0, 0, 0, 0, 0, 0, 80, 64, 64, 0]]
    # links take no room: the task (block 9) stands 48 tokens earlier than its index
    assert found.links_end.tolist() == [144] and found.link_tokens.tolist() == [48]


def test_without_links_nothing_moves_and_only_prompt_links_count():
    found = layout([1, 3, 9, 3, 4, 9], block_size=16)
    assert found.links_end.tolist() == [0] and found.link_tokens.tolist() == [0]
    # a prompt of 5 blocks ending inside its 2-block link: the blocks after it (generated)
    # are not links
    ends_in_link = span_layout(torch.tensor([[1, 3, 9, 6, 9, 9, 9]]), P, 16,
                               prompt_lens=torch.tensor([80]))
    assert ends_in_link.links_end.tolist() == [80] and ends_in_link.link_tokens.tolist() == [32]


def test_a_prompt_ending_in_links_batched_with_a_longer_one_keeps_its_layout():
    """The batch's rows are as wide as its longest request. Past a prompt that ends
    inside its links, blocks are no links: they used to carry span blocks and hide them
    (here the second span's tail and the second link itself), so the prompt's link KV
    depended on what it was batched with, and was cached under its link hashes."""
    ends_in_links = [1, 3, 9, 3, 9, 6, 6]  # header, span, span (2 blocks), link, link
    alone = span_layout(torch.tensor([ends_in_links]), P, 16, prompt_lens=torch.tensor([109]))
    longer = [1] * 11  # a plain request of 176 tokens
    batch = span_layout(torch.tensor([ends_in_links + [9] * 4, longer]), P, 16,
                        prompt_lens=torch.tensor([109, 176]))
    for name in ("span_of", "context_pos", "shift", "frame_offset"):
        assert getattr(batch, name)[0, :7].tolist() == getattr(alone, name)[0].tolist(), name
    assert batch.links_end.tolist()[0] == alone.links_end.tolist()[0]


def test_link_queries_see_what_precedes_them_logically():
    # block size 2: header (0-1), span 1 (2-5), span 2 (6-7), link 1 (8-9), task (10)
    found = layout([1, 3, 9, 3, 6, 4], block_size=2)
    seen = visible_keys(found, 0, seq_len=11, num_queries=11, block_size=2)
    sees = {q: [k for k in range(11) if seen[q, k]] for q in range(11)}
    assert sees[5] == [2, 3, 4, 5]  # span 1's tail sees its own (solo) head
    assert sees[7] == [6, 7]  # span 2 alone
    assert sees[8] == [0, 1, 8]  # link 1: the header, then itself
    assert sees[9] == [0, 1, 8, 9]
    # the task: everything but span 1's solo head, replaced by link 1
    assert sees[10] == [0, 1, 4, 5, 6, 7, 8, 9, 10]


def test_a_second_live_engine_in_one_process_is_refused():
    from minipic.attention import span_layout

    class Runner:  # stands for a model runner: only its identity matters here
        pass

    first, second = Runner(), Runner()
    span_layout.register_runner(first, P)
    with pytest.raises(span_layout.OneEnginePerProcessError, match="one engine per process"):
        span_layout.register_runner(second, P)
    del first  # shut down: the next engine may start
    span_layout.register_runner(second, P)
    del second


def test_turning_back_is_a_pure_rotation_with_a_scaled_table():
    """A table with YaRN's mscale folded in (rows a*cos, a*sin): rotating x by p with it
    scales x by a, as the model does to Q and K alike; turning back must not scale again,
    or a link's Q and K (turned back) would carry a^2 more than every other token."""
    from minipic.attention.rotation import rotate, turn_back
    from minipic.devtools.paged_attention_case import rope_table

    table = rope_table(8, 64, mscale=1.3)
    x = torch.randn(5, 2, 8, generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([3, 9, 17, 30, 40])
    back = turn_back(rotate(x, pos, table, 8, True), pos, table, 8, True)
    assert torch.allclose(back, 1.3 * x, atol=1e-5)


def test_quiet_tokens_take_no_room():
    """mask_markers: header [1 9 pad pad], span [SSep 9 9 pad], task [PDep 9 9 9] (blocks of
    4): the real tokens stand at 0..6, as in the plain prompt [1 9][9 9][9 9 9]."""
    from minipic.attention.span_layout import quiet_keys, take_no_room

    tokens = torch.tensor([[1, 9, 5, 5, 3, 9, 9, 5, 4, 9, 9, 9]])
    found = layout(tokens[0, ::4].tolist(), block_size=4)
    take_no_room(found, quiet_keys(tokens, P), 4)
    real = ~found.quiet[0]
    assert found.logical[0][real].tolist() == [0, 1, 2, 3, 4, 5, 6]
    # the span, stored relative to its SSep, is read from one before its first body token,
    # where its SSep stands
    assert found.read_offset.tolist() == [[0, 1, 0]]
    assert found.logical[0, 4] == 1


def test_a_span_sees_its_own_marker_and_nothing_after_it_does():
    """mask_markers: a span's SSep is the sink its tokens attended to when it was
    prefilled alone; the task after it sees neither it nor padding, and a span prefilled
    alone is plain causal attention (stock kernels), with a task after it is not."""
    from minipic.attention.span_layout import quiet_keys, take_no_room, visible_keys

    tokens = torch.tensor([[3, 9, 9, 5, 4, 9, 9, 9]])  # span [SSep 9 9 pad], task [PDep 9 9 9]
    found = layout(tokens[0, ::4].tolist(), block_size=4)
    take_no_room(found, quiet_keys(tokens, P), 4)
    seen = visible_keys(found, 0, 8, 8, 4)
    assert seen[1:3, 0].all()  # the span's body sees its SSep
    assert not seen[4:, 0].any() and not seen[5:, 3].any() and not seen[5:, 4].any()
    assert seen[5:, 1:3].all()
    assert not found.is_plain()
    alone = layout([3, 9], block_size=4)
    take_no_room(alone, quiet_keys(torch.tensor([[3, 9, 9, 9, 9, 9, 5, 5]]), P), 4)
    assert alone.is_plain()


def test_quiet_tokens_and_links_take_no_room_together():
    """EPIC, blocks of 4: header [1 9 pad pad], span [SSep 9 9 9][9 pad pad pad], link
    [L 9 9 9], task [PDep 9 9 9]: the link stands at its span's head, the tail after it,
    the task after the tail, every marker and pad taking no room."""
    from minipic.attention.span_layout import quiet_keys, take_no_room

    tokens = torch.tensor([[1, 9, 5, 5, 3, 9, 9, 9, 9, 5, 5, 5, 6, 9, 9, 9, 4, 9, 9, 9]])
    found = layout(tokens[0, ::4].tolist(), block_size=4)
    take_no_room(found, quiet_keys(tokens, P), 4)
    logical = found.logical[0]
    assert logical[13:16].tolist() == [2, 3, 4]  # the link's body: the span head's place
    assert logical[8].tolist() == 5  # the tail's token
    assert logical[17:20].tolist() == [6, 7, 8]  # the task right after it
    assert logical[5:8].tolist() == [2, 3, 4]  # the solo head shares its link's places
    assert logical[4] == 1  # its SSep one before, where the tail reads it from


def test_only_the_batchs_own_tokens_decide_whether_keys_turn():
    """A task computed after cached spans (a span hit) has nothing to turn: the span
    frames in the table are the cached keys'. It used to rotate every layer by 0."""
    from minipic.attention.span_layout import key_turn_backs, token_shifts

    found = layout([1, 3, 9, 3, 9, 4], block_size=16)  # header, two spans, PDep task
    seq_len = 6 * 16
    task_only = key_turn_backs(found, [0, 16], [seq_len], 16)
    assert task_only is None and token_shifts(found, [0, 16], [seq_len], 16) is None
    second_span_and_task = key_turn_backs(found, [0, 48], [seq_len], 16)
    assert second_span_and_task.tolist() == [48] * 32 + [0] * 16
    # links: a task past them is turned (stored at its logical position)
    linked = layout([1, 3, 9, 6, 4], block_size=16)
    assert key_turn_backs(linked, [0, 16], [5 * 16], 16).tolist() == [16] * 16
    assert token_shifts(linked, [0, 16], [5 * 16], 16) is None  # only link tokens' Q turns


def _logical_one_row_at_a_time(layout, quiet, block_size):
    """logical_positions as first written: a sort and a search per request."""
    from minipic.attention.span_layout import HIDDEN

    reqs, n = quiet.shape
    index = torch.arange(n).expand(reqs, -1)
    block = index // block_size
    in_span = layout.span_of.gather(1, block) >= 0
    past_links = (index >= layout.links_end[:, None]) & ~in_span & (layout.links_end[:, None] > 0)
    base = index - layout.shift.gather(1, block) \
        - torch.where(past_links, layout.link_tokens[:, None], 0)
    seen = layout.context_pos.gather(1, block) != HIDDEN
    logical = torch.empty_like(base)
    for r in range(reqs):
        counted = base[r][seen[r] & quiet[r]].sort().values
        logical[r] = base[r] - torch.searchsorted(counted, base[r])
    return logical.to(torch.int32)


def test_logical_positions_of_a_whole_batch_at_once():
    """The batched count (one scatter, one running sum) equals the per-request one on
    random EPIC batches with random quiet tokens."""
    from minipic.attention.span_layout import logical_positions

    gen = torch.Generator().manual_seed(0)
    rows = ["-S-S-LLP--", "-SS-SLP", "S--P", "-S-LP-"]
    for _ in range(20):
        found = layout(*[[{"-": 9, "S": 3, "L": 6, "P": 4}[c] for c in r.ljust(10, "-")]
                         for r in rows], block_size=4)
        quiet = torch.rand(len(rows), 40, generator=gen) < 0.3
        assert torch.equal(logical_positions(found, quiet, 4),
                           _logical_one_row_at_a_time(found, quiet, 4))


def test_the_layout_covers_the_batchs_sequences_not_max_model_len(monkeypatch):
    """The runner's token rows are max_model_len wide; per token tables (mask_markers)
    used to be that wide for every request of every step."""
    import weakref

    from minipic.attention import span_layout as sl

    class Runner:  # the V1 runner's token table, 4096 wide
        input_batch = type("Batch", (), {})()

    runner = Runner()
    rows = torch.full((2, 4096), 9)
    rows[:, [0, 32]] = torch.tensor([3, 4])  # SSep span, then the PDep task
    runner.input_batch.token_ids_cpu_tensor = rows
    runner.input_batch.num_prompt_tokens = torch.tensor([70, 40]).numpy()
    for name, value in (("_runner", weakref.ref(runner)), ("_protocol", P),
                        ("_mask_markers", True)):
        monkeypatch.setattr(sl, name, value)  # what register_runner sets, undone after
    found = sl.current_layout(2, 32, max_seq_len=70)
    assert found.span_of.shape == (2, 3) and found.quiet.shape == (2, 96)


def test_span_scale_weighs_span_keys_for_queries_outside_spans_only():
    from minipic.attention.span_layout import span_key_bias
    from minipic.attention.torch_backend import _weighs_spans

    # [SSep doc][PDep task], block 2: a span at the prompt's start, so the layout is plain
    # (stock attention gives it its KV), but the task's queries still weigh the span's keys
    layout = span_layout(torch.tensor([[3, 4]]), P, 2, torch.tensor([4]))
    assert layout.is_plain()
    assert _weighs_spans(layout, 0.5) and not _weighs_spans(layout, 1.0)
    bias = span_key_bias(layout, 0, 4, 4, 2, 0.5)
    log_half = torch.log(torch.tensor(0.5))
    assert torch.equal(bias[:2], torch.zeros(2, 4))  # the span's own queries: as computed
    assert torch.allclose(bias[2:, :2], log_half.expand(2, 2))  # the task on the span's keys
    assert torch.equal(bias[2:, 2:], torch.zeros(2, 2))  # the task on its own keys
    plain = span_layout(torch.tensor([[1, 1]]), P, 2, torch.tensor([4]))  # no span at all
    assert not _weighs_spans(plain, 0.5)
