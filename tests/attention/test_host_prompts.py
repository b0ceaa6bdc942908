"""Model Runner V2's span layout from the host copy of its prompts (no GPU read-back):
the same layout as from the runner's token table."""

import random
import weakref

import numpy as np
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
    prompts, rng = HostPrompts(), random.Random(0)
    runs = {row: span_prompt(rng, rng.randrange(1, 9)) for row in (4, 0, 7)}
    for row, prompt in runs.items():
        prompts.add(row, prompt)
    firsts, lengths = prompts.block_firsts(np.array([7, 4]), BLOCK, 10)
    for i, row in enumerate((7, 4)):
        shown = runs[row][::BLOCK]
        assert firsts[i, : len(shown)].tolist() == shown and (firsts[i, len(shown):] == -1).all()
        assert lengths[i] == len(runs[row])
    prompts.add(7, [3] * 40)  # the row runs another request now
    assert prompts.block_firsts(np.array([7]), BLOCK, 4)[0].tolist() == [[3, 3, 3, -1]]


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

    class Runner:
        pass

    runner = Runner()
    runner.minipic_host_prompts = HostPrompts()
    for row, prompt in prompts.items():
        runner.minipic_host_prompts.add(row, prompt)
    for name, value in (("_runner", weakref.ref(runner)), ("_protocol", P),
                        ("_mask_markers", False), ("_mrv2_idx_mapping_np", rows)):
        monkeypatch.setattr(sl, name, value)  # what register_runner and prepare_inputs set
    got = sl.current_layout(len(rows), BLOCK, max_seq_len=width)
    assert got.span_of.device.type == "cpu"
    for field in ("span_of", "context_pos", "shift", "frame_offset", "links_end", "link_tokens"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
