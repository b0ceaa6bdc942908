"""Worker side: a span batch as FlashAttention calls, one causal and one non-causal.

Keys are stored in their frames (span_layout.SpanLayout.frame_offset), and a score
depends only on the difference of positions (R(a)R(b) = R(a+b)). So a query sees a
group of keys stored in one frame correctly if the query is turned back by that
frame's offset: the keys need no rotation, and stock FlashAttention over the paged
cache computes the group's attention. A request's visible keys fall into such groups
whole blocks at a time (spans, links and the task start at block boundaries), so
each query run (the request's query tokens inside one segment of blocks that share
span, frame and link shift) needs:
  * one causal row: the run's own segment up to its last query, preceded by every
    earlier visible block in the run's own frame (the header for a task, earlier
    links for a link). Every query token is in exactly one such row, in batch order;
  * one non-causal row per other frame among its earlier visible blocks (each
    cached span's tail for a task), with the run's queries turned back by it.
The rows' results are merged by their log-sum-exp (`segment_attention.merge`), as
vLLM's cascade attention merges a shared prefix with the rest.

Built on the host, once per batch, in a fixed number of tensor operations whatever
the batch size (a decode step may hold a thousand requests), for batches whose layout
is not plain and has no quiet keys (mask_markers hides single keys, which whole-block
rows cannot express).
"""

from __future__ import annotations

import dataclasses

import torch

from minipic.attention.span_layout import SpanLayout


@dataclasses.dataclass
class FlashRows:
    """One varlen FlashAttention call over the paged cache.

    `query_index` [tokens]: which query token of the batch each row token is;
    `query_turn` [tokens]: how far that token's Q is turned back for this row;
    `cu_seqlens_q`, `seqused_k` [rows]: as FlashAttention takes them;
    `row_request` [rows] and `row_blocks` [rows, width]: the block table of each row,
    as a request and the logical blocks of it (block_table[row_request, row_blocks]
    on the device gives the physical ones)."""

    query_index: torch.Tensor
    query_turn: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seqused_k: torch.Tensor
    row_request: torch.Tensor
    row_blocks: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)}


@dataclasses.dataclass
class SegmentPlan:
    own: FlashRows  # causal: each query token's own segment (query_index = arange)
    earlier: FlashRows | None  # non-causal: earlier blocks in other frames; None if none
    # For the merge, query token t's earlier row tokens are
    # merge_entries[merge_starts[t]:merge_starts[t + 1]] (None without earlier rows).
    merge_starts: torch.Tensor | None = None
    merge_entries: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> "SegmentPlan":
        """The plan on `device`, in one copy per dtype (a dozen small copies would each
        wait for the device)."""
        parts = {("own", name): t for name, t in self.own.tensors().items()}
        if self.earlier is not None:
            parts.update({("earlier", name): t for name, t in self.earlier.tensors().items()})
            parts[("plan", "merge_starts")] = self.merge_starts
            parts[("plan", "merge_entries")] = self.merge_entries
        moved = _move_packed(parts, torch.device(device))

        def rows(which: str, host: FlashRows) -> FlashRows:
            return dataclasses.replace(host, **{name: t for (part, name), t in moved.items()
                                                if part == which})

        if self.earlier is None:
            return SegmentPlan(rows("own", self.own), None)
        return SegmentPlan(rows("own", self.own), rows("earlier", self.earlier),
                           moved[("plan", "merge_starts")], moved[("plan", "merge_entries")])


def _move_packed(tensors: dict, device: torch.device) -> dict:
    """`tensors` on `device`: those of one dtype concatenated, copied once, split again."""
    moved = {}
    for dtype in {t.dtype for t in tensors.values()}:
        keys = [k for k, t in tensors.items() if t.dtype == dtype]
        flat = torch.cat([tensors[k].reshape(-1) for k in keys])
        if device.type == "cuda":
            flat = flat.pin_memory()
        flat = flat.to(device, non_blocking=True)
        for k, piece in zip(keys, flat.split([tensors[k].numel() for k in keys])):
            moved[k] = piece.view(tensors[k].shape)
    return moved


def segment_plan(layout: SpanLayout, query_start_loc: list[int], seq_lens: list[int],
                 block_size: int) -> SegmentPlan:
    """The FlashAttention rows of a batch (`layout` on the host, without quiet keys)."""
    if layout.quiet is not None:
        raise ValueError("quiet keys hide single keys: the segment plan cannot express them")
    runs = _QueryRuns(layout, query_start_loc, seq_lens, block_size)
    turn = runs.key_turns()
    visible = runs.earlier_visible()
    same_frame = visible & (turn == runs.own_turn(turn)[:, None])
    own = runs.own_rows(same_frame, turn)
    earlier = runs.earlier_rows(visible & ~same_frame, turn)
    if earlier is None:
        return SegmentPlan(own, None)
    tokens = own.query_index.numel()
    counts = torch.bincount(earlier.query_index, minlength=tokens)
    starts = torch.zeros(tokens + 1, dtype=torch.int32)
    starts[1:] = counts.cumsum(0)
    entries = earlier.query_index.argsort(stable=True).to(torch.int32)
    return SegmentPlan(own, earlier, starts, entries)


class _QueryRuns:
    """The batch's query runs: per request, its query positions split where a block
    starts a new segment (another span, frame or link shift). Run n is request
    `request[n]`'s positions [first[n], end[n]) in the segment starting at block
    `segment[n]`; its query tokens in the batch start at `token[n]`."""

    def __init__(self, layout: SpanLayout, query_start_loc: list[int], seq_lens: list[int],
                 block_size: int) -> None:
        self.layout, self.block_size = layout, block_size
        span_of, frame, shift = layout.span_of, layout.frame_offset, layout.shift
        reqs, blocks = span_of.shape
        self.block = torch.arange(blocks)
        starts_segment = torch.ones(reqs, blocks, dtype=torch.bool)
        starts_segment[:, 1:] = ((span_of[:, 1:] != span_of[:, :-1])
                                 | (frame[:, 1:] != frame[:, :-1])
                                 | (shift[:, 1:] != shift[:, :-1]))
        segment_of = torch.where(starts_segment, self.block, 0).cummax(dim=1).values
        qsl = torch.tensor(query_start_loc[: reqs + 1])
        seq = torch.tensor(seq_lens[:reqs])
        start = seq - (qsl[1:] - qsl[:-1])  # each request's first query position
        first_block, last_block = start // block_size, (seq - 1) // block_size
        in_queries = (self.block >= first_block[:, None]) & (self.block <= last_block[:, None])
        heads = in_queries & (starts_segment | (self.block == first_block[:, None]))
        self.request, head_block = heads.nonzero(as_tuple=True)  # by request, then block
        r = self.request
        self.first = torch.maximum(head_block * block_size, start[r])
        follows = torch.zeros_like(r, dtype=torch.bool)
        follows[:-1] = r[1:] == r[:-1]  # the next run is the same request's
        self.end = torch.where(follows, self.first.roll(-1), seq[r])
        self.segment = segment_of[r, head_block]
        self.token = qsl[r] + self.first - start[r]
        self.length = self.end - self.first

    def key_turns(self) -> torch.Tensor:
        """[runs, blocks]: how far each run's queries are turned back to score each block's
        keys: the block's frame offset (keys read where they stand), plus link_tokens for
        keys before the links when the run is past them (links take no room)."""
        layout, r = self.layout, self.request
        frame = layout.frame_offset[r].long()
        if layout.links_end is None:
            return frame
        links_end = layout.links_end[r].long()
        past = (links_end > 0) & (self.first >= links_end)
        before = self.block[None, :] * self.block_size < links_end[:, None]
        room = torch.where(past[:, None] & before, layout.link_tokens[r].long()[:, None], 0)
        return frame + room

    def own_turn(self, turn: torch.Tensor) -> torch.Tensor:
        return turn.gather(1, self.segment[:, None]).squeeze(1)

    def earlier_visible(self) -> torch.Tensor:
        """[runs, blocks]: the blocks before each run's segment that its queries see, whole
        (see span_layout): none for a span's queries (a span sees itself only), else every
        block whose logical position comes before the segment's (a link's carried head
        is HIDDEN)."""
        r, segment = self.request, self.segment[:, None]
        context = self.layout.context_pos[r].long()
        outside_spans = self.layout.span_of[r].gather(1, segment) < 0
        return ((self.block[None, :] < segment) & outside_spans
                & (context < context.gather(1, segment)))

    def own_rows(self, same_frame: torch.Tensor, turn: torch.Tensor) -> FlashRows:
        """One causal row per run: the earlier blocks in its own frame, then its segment
        up to its last query (every query token once, in batch order)."""
        last = (self.end - 1) // self.block_size
        own = (self.block[None, :] >= self.segment[:, None]) & (self.block[None, :] <= last[:, None])
        taken = same_frame | own
        width = int(taken.sum(dim=1).max())
        blocks = torch.where(taken, self.block[None, :], self.block.numel()).sort(dim=1).values
        key_lens = same_frame.sum(dim=1) * self.block_size + self.end - self.segment * self.block_size
        return _rows(torch.arange(int(self.length.sum())),
                     self.own_turn(turn).repeat_interleave(self.length),
                     self.length, key_lens, self.request,
                     torch.where(blocks < self.block.numel(), blocks, 0)[:, :width])

    def earlier_rows(self, other_frames: torch.Tensor, turn: torch.Tensor) -> FlashRows | None:
        """One non-causal row per (run, frame) among the earlier visible blocks in frames
        other than the run's own, the run's queries turned back by that frame's turn."""
        run, block = other_frames.nonzero(as_tuple=True)  # by run, then block
        if run.numel() == 0:
            return None
        turns = turn[run, block]
        # A row per stretch of one run's blocks in one frame (a cached span's tail): any
        # split of a run's keys into rows is exact, the merge sums them.
        new_row = torch.ones_like(run, dtype=torch.bool)
        new_row[1:] = (run[1:] != run[:-1]) | (turns[1:] != turns[:-1])
        row_of = new_row.cumsum(0) - 1
        heads = new_row.nonzero().squeeze(1)
        counts = torch.diff(heads, append=torch.tensor([run.numel()]))
        slot = torch.arange(block.numel()) - heads[row_of]
        table = torch.zeros(heads.numel(), int(counts.max()), dtype=torch.int64)
        table[row_of, slot] = block
        row_run, row_turn = run[heads], turns[heads]
        lengths = self.length[row_run]
        offsets = torch.arange(int(lengths.sum())) - (lengths.cumsum(0) - lengths).repeat_interleave(lengths)
        return _rows(self.token[row_run].repeat_interleave(lengths) + offsets,
                     row_turn.repeat_interleave(lengths), lengths,
                     counts * self.block_size, self.request[row_run], table)


def _rows(query_index: torch.Tensor, query_turn: torch.Tensor, query_lens: torch.Tensor,
          key_lens: torch.Tensor, row_request: torch.Tensor, row_blocks: torch.Tensor
          ) -> FlashRows:
    cu = torch.zeros(query_lens.numel() + 1, dtype=torch.int32)
    cu[1:] = query_lens.cumsum(0)
    return FlashRows(query_index=query_index.long(), query_turn=query_turn.to(torch.int32),
                     cu_seqlens_q=cu, seqused_k=key_lens.to(torch.int32),
                     row_request=row_request.long(), row_blocks=row_blocks.long(),
                     max_seqlen_q=int(query_lens.max()), max_seqlen_k=int(key_lens.max()))
