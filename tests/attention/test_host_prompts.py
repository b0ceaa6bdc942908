"""Model Runner V2's span layout from the host copy of its prompts (no GPU read-back):
the same layout as from the runner's token table."""

import random
import weakref

import numpy as np
import pytest
import torch

from minipic.attention import span_layout as sl
from minipic.attention.host_prompts import HostPrompts
from minipic.protocol import SpanProtocol

P = SpanProtocol(ssep_token_id=3, pdep_token_id=4, pad_token_id=5, link_token_id=6)
BLOCK = 16


def span_prompt(rng: random.Random, blocks: int) -> list[int]:
    """Random whole blocks, each starting with a marker or a word, then a ragged tail."""
    tokens = []
    for _ in range(blocks):
        tokens += [rng.choice([3, 4, 6, 9, 9])] + [rng.randrange(10, 99) for _ in range(BLOCK - 1)]
    return tokens + [rng.randrange(10, 99) for _ in range(rng.randrange(1, BLOCK))]


def test_block_firsts_are_the_prompt_blocks_first_tokens():
    prompts, rng = HostPrompts(P), random.Random(0)
    runs = {row: span_prompt(rng, rng.randrange(1, 9)) for row in (4, 0, 7)}
    for row, prompt in runs.items():
        prompts.add(row, prompt)
    firsts, _, lengths = prompts.blocks(np.array([7, 4]), BLOCK, 10)
    for i, row in enumerate((7, 4)):
        shown = runs[row][::BLOCK]
        assert firsts[i, : len(shown)].tolist() == shown and (firsts[i, len(shown):] == -1).all()
        assert lengths[i] == len(runs[row])
    prompts.add(7, [3] * 40)  # the row runs another request now
    assert prompts.blocks(np.array([7]), BLOCK, 4)[0].tolist() == [[3, 3, 3, -1]]


class Runner:
    pass


def mrv2_runner(monkeypatch, prompts: dict, rows: np.ndarray) -> Runner:
    """A stand-in Model Runner V2 holding `prompts` by row, running `rows`, registered as
    register_runner and prepare_inputs would (its token table is never read here)."""
    runner = Runner()
    runner.req_states = None  # an MRV2 runner (its GPU token table unused: no idx_mapping)
    runner.minipic_host_prompts = HostPrompts(P)
    for row, prompt in prompts.items():
        runner.minipic_host_prompts.add(row, prompt)
    for name, value in (("_runner", weakref.ref(runner)), ("_protocol", P),
                        ("_mask_markers", False), ("_mrv2_idx_mapping_np", rows),
                        ("_last_host_layout", None)):
        monkeypatch.setattr(sl, name, value)
    return runner


def test_a_decode_step_over_the_same_requests_reuses_the_layout(monkeypatch):
    """The same rows and prompts, a width within the same HOST_LAYOUT_BLOCK_STEP blocks:
    the last step's layout object (and the plan's tables of it), also when a decode step
    crosses into a new block; a new prompt in a row, another batch or a batch past those
    blocks: a new layout."""
    rng = random.Random(6)
    rows = np.array([1, 0])
    prompts = {row: span_prompt(rng, 6) for row in rows.tolist()}
    runner = mrv2_runner(monkeypatch, prompts, rows)
    step = sl.HOST_LAYOUT_BLOCK_STEP
    first = sl.current_layout(2, BLOCK, max_seq_len=7 * BLOCK)
    assert first.span_of.shape[1] == step
    assert sl.current_layout(2, BLOCK, max_seq_len=7 * BLOCK - 3) is first  # same block
    assert sl.current_layout(2, BLOCK, max_seq_len=7 * BLOCK + 1) is first  # the next one
    assert first.to("cpu") is first
    longest = (step + 1) * BLOCK
    wider = sl.current_layout(2, BLOCK, max_seq_len=longest)
    assert wider is not first and wider.span_of.shape[1] == 2 * step
    assert torch.equal(wider.span_of[:, :step], first.span_of)
    monkeypatch.setattr(sl, "_mrv2_idx_mapping_np", rows[::-1].copy())
    swapped = sl.current_layout(2, BLOCK, max_seq_len=longest)
    assert swapped is not wider and torch.equal(swapped.span_of, wider.span_of.flip(0))
    runner.minipic_host_prompts.add(0, [4] + words(rng, 90))  # row 0 runs another request
    replaced = sl.current_layout(2, BLOCK, max_seq_len=longest)
    assert replaced is not swapped and (replaced.span_of[0] < 0).all()
    # Row 1 finished; a dummy batch still names it: no host layout (the runner's own
    # table speaks for such batches; this stand-in has no device rows), and no crash.
    runner.minipic_host_prompts.remove(1)
    assert sl.current_layout(2, BLOCK, max_seq_len=longest) is None


def test_mrv2_layout_from_host_prompts_matches_the_token_table(monkeypatch):
    """Generated tokens past each prompt (markers among them) count for nothing, as in
    the token-table layout: the two layouts agree field by field."""
    rng = random.Random(1)
    rows = np.array([5, 2, 9])
    prompts = {row: span_prompt(rng, rng.randrange(2, 12)) for row in rows.tolist()}
    generated = {row: [rng.choice([3, 4, 9]) for _ in range(40)] for row in prompts}
    width = max(len(p) + 40 for p in prompts.values())
    table = torch.full((len(rows), width), 9)
    for i, row in enumerate(rows.tolist()):
        seq = prompts[row] + generated[row]
        table[i, : len(seq)] = torch.tensor(seq)
    want = sl.span_layout(table[:, ::BLOCK], P, BLOCK,
                          torch.tensor([len(prompts[r]) for r in rows.tolist()]))

    runner = mrv2_runner(monkeypatch, prompts, rows)
    got = sl.current_layout(len(rows), BLOCK, max_seq_len=width)
    assert got.span_of.device.type == "cpu"
    blocks = want.span_of.shape[1]  # the host layout may be wider (HOST_LAYOUT_BLOCK_STEP)
    for field in ("span_of", "context_pos", "shift", "frame_offset"):
        assert torch.equal(getattr(got, field)[:, :blocks], getattr(want, field)), field
    for field in ("links_end", "link_tokens"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    # ids for span blocks only: all of them but a prompt's partial last block, and none of
    # a span that runs to the prompt's end (no other row reads it)
    full = torch.arange(got.span_of.shape[1]) < torch.tensor(
        [len(prompts[r]) // BLOCK for r in rows.tolist()])[:, None]
    last_marker = torch.tensor([max((i for i, first in enumerate(prompts[r][::BLOCK])
                                     if first in P.markers), default=-1)
                                for r in rows.tolist()])
    followed = got.span_of < last_marker[:, None]
    assert torch.equal(got.span_id >= 0, (got.span_of >= 0) & full & followed)
    assert (got.span_id >= 0).any() and ((got.span_of >= 0) & ~followed).any()


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 99) for _ in range(n)]


def test_the_same_document_anywhere_gets_the_same_span_ids():
    """A document's blocks get one id wherever its span sits; another document, the header,
    the task and a prompt's partial last block get none in common (-1 outside spans)."""
    rng = random.Random(2)
    doc, other = [3] + words(rng, 47), [3] + words(rng, 47)  # three blocks each
    task = [4] + words(rng, 20)
    prompts = HostPrompts(P)
    prompts.add(0, words(rng, 16) + doc + other + task)
    prompts.add(1, words(rng, 32) + other + doc + task)
    _, ids, _ = prompts.blocks(np.array([0, 1]), BLOCK, 9)
    assert ids[0, 1:4].tolist() == ids[1, 5:8].tolist()  # doc
    assert ids[0, 4:7].tolist() == ids[1, 2:5].tolist()  # other
    assert len(set(ids[0, 1:7].tolist())) == 6
    assert ids[0, 0] == ids[0, 7] == ids[0, 8] == -1  # header, task
    assert ids[1, :2].tolist() == [-1, -1] and ids[1, 8] == -1


def test_only_the_rows_named_get_span_ids_and_only_they_are_hashed():
    rng = random.Random(4)
    doc = [3] + words(rng, 47)
    prompts = HostPrompts(P)
    for row in range(3):
        prompts.add(row, words(rng, 16) + doc + [4] + words(rng, 5))
    rows = np.array([0, 1, 2])
    _, ids, _ = prompts.blocks(rows, BLOCK, 6, span_ids=np.array([True, False, True]))
    assert ids[0, 1:4].tolist() == ids[2, 1:4].tolist() and ids[0, 1] >= 0
    assert ids[1].tolist() == [-1] * 6
    assert 1 not in prompts._tables[BLOCK].has_ids  # row 1 was not hashed
    assert prompts.blocks(rows, BLOCK, 6, span_ids=np.zeros(3, dtype=bool))[1] is None
    _, all_ids, _ = prompts.blocks(rows, BLOCK, 6)  # True: every row
    assert all_ids[1, 1:4].tolist() == ids[0, 1:4].tolist()


def test_a_span_id_is_the_whole_spans_tokens_and_the_blocks_place():
    """One token differs, in the second block: every block of the span gets another id
    (an id stands for the span's tokens and the block's place in it), and the same span
    at a block size of its own gets ids of its own."""
    rng = random.Random(3)
    doc = [3] + words(rng, 47)
    changed = list(doc)
    changed[20] += 1  # the second block
    prompts = HostPrompts(P)
    prompts.add(0, doc + [4] + words(rng, 5))
    prompts.add(1, changed + [4] + words(rng, 5))
    prompts.add(2, doc + [4] + words(rng, 9))
    _, ids, _ = prompts.blocks(np.array([0, 1, 2]), BLOCK, 4)
    assert ids[0, :3].tolist() == ids[2, :3].tolist()
    assert not set(ids[0, :3].tolist()) & set(ids[1, :3].tolist())
    _, wide, _ = prompts.blocks(np.array([0, 2]), 2 * BLOCK, 2)
    assert wide[0, 0] == wide[1, 0] and wide[0, 0] not in ids[:, :3]


def test_rows_and_prompts_of_any_size_keep_their_blocks():
    """Rows far apart and prompts longer than any before grow the tables; every row keeps
    its blocks, and a row that runs a shorter prompt now shows none of the longer one."""
    rng = random.Random(9)
    runs = {0: span_prompt(rng, 2), 40: span_prompt(rng, 30), 3: span_prompt(rng, 5),
            900: span_prompt(rng, 90)}
    prompts = HostPrompts(P)
    for row, prompt in runs.items():
        prompts.add(row, prompt)
        prompts.blocks(np.array([row]), BLOCK, 4)  # filled as it comes
    rows = np.array(list(runs))
    firsts, ids, lengths = prompts.blocks(rows, BLOCK, 100)
    for i, prompt in enumerate(runs.values()):
        shown = prompt[::BLOCK]
        assert firsts[i, : len(shown)].tolist() == shown and (firsts[i, len(shown):] == -1).all()
        assert lengths[i] == len(prompt)
    short = [3] + words(rng, 31) + [4] + words(rng, 3)
    prompts.add(900, short)
    firsts, ids, _ = prompts.blocks(np.array([900]), BLOCK, 100)
    assert firsts[0, :3].tolist() == short[::BLOCK] and (firsts[0, 3:] == -1).all()
    assert (ids[0, :2] >= 0).all() and (ids[0, 2:] == -1).all()  # the span, then the task


def test_span_ids_are_freed_with_their_last_prompt():
    """The id table holds the running prompts' spans only (a server's traffic would
    grow it without end)."""
    rng = random.Random(4)
    doc = [3] + words(rng, 31)
    prompts = HostPrompts(P)
    for row in (0, 1):
        prompts.add(row, doc + [4] + words(rng, 3))
        prompts.blocks(np.array([row]), BLOCK, 3)
    assert len(prompts.span_ids) == 1  # one span, held by two prompts
    prompts.add(0, [4] + words(rng, 40))
    prompts.blocks(np.array([0]), BLOCK, 3)
    assert len(prompts.span_ids) == 1
    prompts.add(1, [4] + words(rng, 40))
    assert len(prompts.span_ids) == 0


def test_a_prompt_whose_kv_is_more_than_its_tokens_shares_nothing():
    """LoRA, multimodal inputs or prompt embeddings: the same tokens, other keys."""
    rng = random.Random(5)
    prompt = [3] + words(rng, 31) + [4] + words(rng, 3)
    prompts = HostPrompts(P)
    prompts.add(0, prompt)
    prompts.add(1, prompt, shareable=False)
    _, ids, _ = prompts.blocks(np.array([0, 1]), BLOCK, 3)
    assert (ids[0, :2] >= 0).all() and (ids[1] == -1).all()


def test_a_removed_request_gives_back_its_prompt_and_ids():
    """Finished or preempted (the runner's _remove_request): nothing of it stays."""
    rng = random.Random(7)
    prompts = HostPrompts(P)
    prompts.add(3, [3] + words(rng, 31) + [4] + words(rng, 3))
    prompts.blocks(np.array([3]), BLOCK, 3)
    assert len(prompts) == 1 and len(prompts.span_ids) == 1
    before = prompts.generation
    prompts.remove(3)
    assert len(prompts) == 0 and len(prompts.span_ids) == 0 and prompts.generation > before


def test_shared_documents_from_host_prompts_to_the_plan(monkeypatch):
    """EPIC prompts from the recipe: two requests over the same documents behind headers of
    other lengths share every document row of a decode step; a third over other documents,
    and a fourth over the same documents but not shareable (a cache_salt, LoRA...), do not."""
    from minipic.attention.segment_plan import segment_plan
    from minipic.client.prompts.recipes import epic

    rng = random.Random(8)
    docs, others = [words(rng, 40) for _ in range(3)], [words(rng, 40) for _ in range(3)]
    prompts = {0: epic(docs, words(rng, 20), system=words(rng, 10), protocol=P,
                       block_size=BLOCK).final,
               1: epic(others, words(rng, 20), system=words(rng, 10), protocol=P,
                       block_size=BLOCK).final,
               2: epic(docs, words(rng, 20), system=words(rng, 30), protocol=P,
                       block_size=BLOCK).final,
               3: epic(docs, words(rng, 20), system=words(rng, 10), protocol=P,
                       block_size=BLOCK).final}
    rows = np.array([0, 1, 2, 3])
    runner = mrv2_runner(monkeypatch, {r: prompts[r] for r in (0, 1, 2)}, rows)
    runner.minipic_host_prompts.add(3, prompts[3], shareable=False)
    seq_lens = [len(prompts[r]) + 5 for r in rows.tolist()]
    layout = sl.current_layout(len(rows), BLOCK, max_seq_len=max(seq_lens))
    plan = segment_plan(layout, list(range(len(rows) + 1)), seq_lens, BLOCK, link_shifts=True)
    earlier = plan.earlier
    sizes = (earlier.cu_seqlens_q[1:] - earlier.cu_seqlens_q[:-1]).tolist()
    shared = [i for i, n in enumerate(sizes) if n > 1]
    assert len(shared) == 3 and all(sizes[i] == 2 for i in shared)  # docs: requests 0 and 2
    assert {int(earlier.row_request[i]) for i in shared} == {0}
    assert earlier.row_request.tolist().count(1) == 3 and earlier.row_request.tolist().count(3) == 3
    layout.span_id = None  # unknown identity: a row per request and document
    assert segment_plan(layout, list(range(len(rows) + 1)), seq_lens, BLOCK,
                        link_shifts=True).earlier.row_request.numel() == 12
    # Request 2 prefills its task this step: no ids for its row, no row shared with it (a
    # layout of its own: the last one's ids were for every row)
    mixed = sl.current_layout(len(rows), BLOCK, max_seq_len=max(seq_lens),
                              decoding=np.array([True, True, False, True]))
    assert mixed.span_id[2].tolist() == [-1] * mixed.span_id.shape[1]
    assert mixed.span_id[0].max() >= 0
    plan = segment_plan(mixed, list(range(len(rows) + 1)), seq_lens, BLOCK, link_shifts=True)
    assert plan.earlier.row_request.numel() == 12


def test_only_unsalted_plain_token_requests_are_tagged_shareable(monkeypatch):
    """What the patches decide: the scheduler tags each new request with its salt; the
    runner shares only untagged-salt, LoRA-free, text-only requests."""
    from types import SimpleNamespace

    from minipic import _vllm_patches as patches

    def new(req_id, **extra):
        fields = dict(req_id=req_id, prompt_token_ids=[3] + list(range(10, 41)) + [4],
                      lora_request=None, mm_features=[], prompt_embeds=None)
        return SimpleNamespace(**{**fields, **extra})

    output = SimpleNamespace(scheduled_new_reqs=[new("a"), new("b"), new("gone")])
    patches._tag_salted({"a": SimpleNamespace(cache_salt=None),
                         "b": SimpleNamespace(cache_salt="tenant-1")}, output)
    assert [n.minipic_salted for n in output.scheduled_new_reqs] == [False, True, True]
    output.scheduled_new_reqs += [new("lora", minipic_salted=False, lora_request=object()),
                                  new("untagged"), new("embeds", minipic_salted=False)]
    output.scheduled_new_reqs[-1].prompt_token_ids = None
    runner = Runner()
    runner.req_states = SimpleNamespace(req_id_to_index={n.req_id: i for i, n in enumerate(
        output.scheduled_new_reqs)})
    monkeypatch.setattr(sl, "_protocol", P)  # what register_runner sets
    patches._note_host_prompts(runner, output)
    _, ids, lengths = runner.minipic_host_prompts.blocks(np.arange(6), BLOCK, 2)
    assert (ids[0] >= 0).all() and (ids[1:] == -1).all()
    assert lengths[-1] == 0  # embeddings only: no tokens, no markers


@pytest.mark.parametrize("seed", [0, 1])
def test_decode_steps_plan_as_from_scratch(monkeypatch, seed):
    """Forty decode steps over one layout: each step's plan, made from the last one, equals
    the plan made from scratch (requests crossing into new blocks at different steps)."""
    import dataclasses

    from minipic.attention import segment_plan as sp
    from minipic.attention.segment_plan import segment_plan
    from minipic.client.prompts.recipes import block_attention, epic

    planned = []  # the layouts planned from scratch
    original = sp._planned
    monkeypatch.setattr(sp, "_planned", lambda layout, *a: planned.append(layout) or
                        original(layout, *a))

    rng = random.Random(seed)
    docs = [words(rng, rng.randrange(20, 60)) for _ in range(4)]
    prompts = {0: epic(docs, words(rng, 9), system=words(rng, 5), protocol=P,
                       block_size=BLOCK).final,
               1: block_attention(docs[1:], words(rng, 30), protocol=P, block_size=BLOCK).final,
               2: words(rng, 70),
               3: epic(docs[::-1], words(rng, 20), system=words(rng, 40), protocol=P,
                       block_size=BLOCK).final}
    rows = np.array([0, 1, 2, 3])
    runner = mrv2_runner(monkeypatch, prompts, rows)  # held weakly by span_layout: keep it
    lens = [len(prompts[r]) + rng.randrange(1, 16) for r in rows.tolist()]
    width = max(lens) + 40
    layout = sl.current_layout(4, BLOCK, max_seq_len=width)
    for step in range(40):
        seq = [n + step for n in lens]
        assert sl.current_layout(4, BLOCK, max_seq_len=width) is layout is not None
        got = segment_plan(layout, list(range(5)), seq, BLOCK, link_shifts=True)
        fresh = segment_plan(dataclasses.replace(layout), list(range(5)), seq, BLOCK,
                             link_shifts=True)
        for part in ("own", "earlier", "joint"):
            a, b = getattr(got, part), getattr(fresh, part)
            for field in dataclasses.fields(a):
                x, y = getattr(a, field.name), getattr(b, field.name)
                assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), \
                    (step, part, field.name)
    assert runner.minipic_host_prompts.holds(rows)
    assert sum(p is layout for p in planned) == 1  # the first step only: the rest stepped on


def _random_prompt(rng: random.Random) -> list[int]:
    """Documents from a small pool (so some repeat), tasks and plain words, cut anywhere:
    prompts of a block or less up to 200 blocks."""
    pool = [[3] + [rng.randrange(10, 13) for _ in range(BLOCK * rng.choice([1, 2, 3]) - 1)]
            for _ in range(4)]
    tokens, wanted = [], rng.choice([1, 2, 5, 20, 70, 200]) * BLOCK
    while len(tokens) < wanted:
        draw = rng.random()
        if draw < 0.4:
            tokens += rng.choice(pool)
        elif draw < 0.6:
            tokens += [4] + [rng.randrange(10, 13) for _ in range(rng.randrange(0, 40))]
        else:
            tokens += [rng.randrange(10, 13) for _ in range(rng.randrange(1, 40))]
    return tokens[: rng.randrange(1, len(tokens) + 1)]


def _expected_keys(prompt: list[int], block_size: int, shareable: bool) -> list:
    """Per block, what its id must stand for: (block size, its span's tokens, its place),
    None for no id (outside spans, the last marker's segment, not shareable)."""
    firsts = prompt[::block_size]
    keys = [None] * len(firsts)
    marked = [b for b, first in enumerate(firsts) if first in P.markers]
    for start, end in zip(marked[:-1], marked[1:]):
        if shareable and firsts[start] == P.ssep_token_id:
            span = tuple(prompt[start * block_size: end * block_size])
            for block in range(start, end):
                keys[block] = (block_size, span, block - start)
    return keys


@pytest.mark.parametrize("seed", range(40))
def test_random_adds_removes_and_gathers_match_the_prompts(seed):
    """Rows across the tables' growth steps, prompts replaced by longer and shorter ones,
    two block sizes, ids asked for or not, gathers narrower and wider than the prompts:
    every gather shows the rows' current prompts, and ids and spans match one to one."""
    rng = random.Random(seed)
    prompts, running = HostPrompts(P), {}
    keys_of: dict = {}  # id -> what it stands for, over the whole run (ids are never reused)
    for _ in range(60):
        row = rng.choice([0, 1, 2, 255, 256, 300, 511, 700, rng.randrange(20)])
        draw = rng.random()
        if draw < 0.5:
            running[row] = (_random_prompt(rng), rng.random() < 0.8)
            prompts.add(row, *running[row])
        elif draw < 0.6 and row in running:
            prompts.remove(row)
            del running[row]
        elif running:
            rows = rng.sample(sorted(running), rng.randrange(1, len(running) + 1))
            block_size, with_ids = rng.choice([BLOCK, 2 * BLOCK]), rng.random() < 0.6
            longest = max(-(-len(running[r][0]) // block_size) for r in rows)
            blocks = max(1, longest + rng.choice([-3, 0, 5, 70]))
            firsts, ids, lengths = prompts.blocks(np.array(rows), block_size, blocks, with_ids)
            ids_of: dict = {}  # in one gather, one span's block has one id
            for i, row_id in enumerate(rows):
                prompt, shareable = running[row_id]
                assert firsts[i].tolist() == (prompt[::block_size] + [-1] * blocks)[:blocks]
                assert lengths[i] == len(prompt)
                if not with_ids:
                    continue
                keys = _expected_keys(prompt, block_size, shareable) + [None] * blocks
                for block in range(blocks):
                    found, key = int(ids[i, block]), keys[block]
                    if key is None:
                        assert found == -1, (row_id, block)
                    else:
                        assert ids_of.setdefault(key, found) == found  # same span, same id
                        assert keys_of.setdefault(found, key) == key  # same id, same span
    for row in list(running):
        prompts.remove(row)
    assert len(prompts.span_ids) == 0
