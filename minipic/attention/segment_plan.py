"""Worker side: a span batch as FlashAttention calls, one causal and one non-causal
(one for a decode batch).

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

Built on the host, once per batch, in a fixed number of array operations whatever
the batch size (a decode step may hold a thousand requests), for batches whose layout
is not plain and has no quiet keys (mask_markers hides single keys, which whole-block
rows cannot express).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
import torch

from minipic.attention.host_copy import to_device_together
from minipic.attention.span_identity import NO_ID
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
    # `own` (as rows of one query each) then `earlier`, as one non-causal call (one
    # FlashAttention launch a layer, not two): see _joint. None: two calls.
    joint: FlashRows | None = None

    def to(self, device: torch.device | str) -> "SegmentPlan":
        """The plan on `device`, in one copy per dtype (a dozen small copies would each
        wait for the device). Beside a joint call the own and earlier rows stay on the
        host: the joint call holds them, and on CUDA nothing reads them (the torch merge,
        which reads earlier.query_index, runs off CUDA only, where host is device)."""
        if self.earlier is None:  # no joint call without earlier rows
            moving = ["own"]
        else:
            moving = ["joint"] if self.joint is not None else ["own", "earlier"]
        parts = {(which, name): t for which in moving
                 for name, t in getattr(self, which).tensors().items()}
        if self.earlier is not None:
            parts[("plan", "merge_starts")] = self.merge_starts
            parts[("plan", "merge_entries")] = self.merge_entries
        moved = dict(zip(parts, to_device_together(list(parts.values()), device)))

        def rows(which: str) -> FlashRows | None:
            host = getattr(self, which)
            if which not in moving:
                return host
            return dataclasses.replace(host, **{name: t for (part, name), t in moved.items()
                                                if part == which})

        if self.earlier is None:
            return SegmentPlan(rows("own"), None)
        return SegmentPlan(rows("own"), rows("earlier"), moved[("plan", "merge_starts")],
                           moved[("plan", "merge_entries")], rows("joint"))


def segment_plan(layout: SpanLayout, query_start_loc: list[int], seq_lens: list[int],
                 block_size: int, link_shifts: bool = False) -> SegmentPlan:
    """The FlashAttention rows of a batch (`layout` on the host, without quiet keys).

    `link_shifts`: the queries are as the model hands them, so a link token's turns
    include its link shift (SpanLayout.shift, its Q to its logical position: one
    rotation, not two); else the caller turned link queries already."""
    if layout.quiet is not None:
        raise ValueError("quiet keys hide single keys: the segment plan cannot express them")
    asked = (list(query_start_loc[: len(seq_lens) + 1]), list(seq_lens), block_size, link_shifts)
    tables = _layout_tables(layout)
    last = layout.derived.get("last_plan")
    plan = None
    if last is not None and last[0] is tables:  # the same tables as then
        if tuple(last[1:-1]) == asked:
            return last[-1]  # the same batch again (another KV cache group's builder)
        # A stepped plan shares its unchanged tensors with the last one: plans are read,
        # never written in place.
        plan = _one_token_on(tables, *last[1:], *asked)
    if plan is None:
        plan = _planned(layout, *asked)
    layout.derived["last_plan"] = (tables, *asked, plan)
    return plan


def _planned(layout: SpanLayout, query_start_loc: list[int], seq_lens: list[int],
             block_size: int, link_shifts: bool) -> SegmentPlan:
    runs = _QueryRuns(layout, query_start_loc, seq_lens, block_size)
    turn = runs.key_turns()
    if link_shifts:  # one shift per run (runs split where the shift changes)
        turn = turn + runs.link_shift()[:, None]
    visible = runs.earlier_visible()
    same_frame = visible & (turn == runs.own_turn(turn)[:, None])
    own_parts = runs.own_rows(same_frame, turn)
    earlier_parts = runs.earlier_rows(visible & ~same_frame, turn)
    own = _rows(*own_parts)
    if earlier_parts is None:
        return SegmentPlan(own, None)
    earlier = _rows(*earlier_parts)
    token = earlier_parts.query_index
    starts = np.zeros(own.query_index.numel() + 1, dtype=np.int32)
    starts[1:] = np.bincount(token, minlength=starts.size - 1).cumsum()
    entries = np.argsort(token, kind="stable").astype(np.int32)
    return SegmentPlan(own, earlier, torch.from_numpy(starts), torch.from_numpy(entries),
                       _joint(own, own_parts, earlier_parts))


# Most keys the causal rows may read in all when each query goes as a row of its own (see
# _joint): a hit's 32-token question after a 64-token header reads 2.6k; a long task chunk
# (keys read once per query instead of once per tile) stays two calls.
JOINT_OWN_KEYS = 1 << 14


def _joint(own: FlashRows, own_parts: "_RowParts", earlier_parts: "_RowParts"
           ) -> FlashRows | None:
    """Both kinds of rows as one non-causal call, where the causal rows can go as rows of
    one query: query i of a causal row of L queries over K keys sees K - (L - 1 - i) keys,
    all of them, which a non-causal row of that one query over those keys computes too.
    A decode batch always (one query per run); a prefill while its single rows read at most
    JOINT_OWN_KEYS keys (a span hit's question: one FlashAttention launch a layer, not two)."""
    if own.max_seqlen_q == 1:
        return _rows(*_joined(own_parts, earlier_parts))
    lens, keys = own_parts.query_lens, own_parts.key_lens
    if int((lens * keys - lens * (lens - 1) // 2).sum()) > JOINT_OWN_KEYS:  # the single rows'
        return None  # keys, counted before a long chunk's per-token arrays are built
    return _rows(*_joined(_one_query_each(own_parts), earlier_parts))


def _one_query_each(rows: "_RowParts") -> "_RowParts":
    """Causal `rows` as rows of one query each (their tokens stay in order)."""
    row = np.repeat(np.arange(rows.query_lens.size), rows.query_lens)
    first = np.cumsum(rows.query_lens) - rows.query_lens
    later_queries = rows.query_lens[row] - 1 - (np.arange(row.size) - first[row])
    return _RowParts(rows.query_index, rows.query_turn, np.ones(row.size, dtype=np.int64),
                     rows.key_lens[row] - later_queries, rows.row_request[row],
                     rows.row_blocks[row])


def _one_token_on(tables: "_LayoutTables", last_starts: list[int], last_lens: list[int],
                  last_block_size: int, last_shifts: bool, plan: SegmentPlan,
                  query_start_loc: list[int], seq_lens: list[int], block_size: int,
                  link_shifts: bool) -> SegmentPlan | None:
    """A decode step's plan from the last step's over the same layout, or None when this
    batch is not that: the same requests, one query each, every one a token further.

    Only each request's own row changes: one key longer, and one block longer where its
    new token starts a block (of the same segment: generated tokens start no span). The
    earlier rows, turns and merge stay, so the step costs a few array writes, not a plan."""
    n = len(seq_lens)
    one_query_each = query_start_loc == list(range(n + 1))
    if not (one_query_each and last_starts == query_start_loc and len(last_lens) == n
            and (last_block_size, last_shifts) == (block_size, link_shifts)
            and (plan.earlier is None or plan.joint is not None)):
        return None
    seq, last = np.asarray(seq_lens, dtype=np.int64), np.asarray(last_lens, dtype=np.int64)
    if not (seq == last + 1).all() or not np.array_equal(plan.own.row_request.numpy(),
                                                         np.arange(n)):
        return None
    new_block = (seq - 1) // block_size
    grows = np.flatnonzero(new_block != (last - 1) // block_size)
    if (new_block[grows] >= tables.block.size).any() \
            or tables.starts_segment[grows, new_block[grows]].any():
        return None
    own = _longer(plan.own, n, grows, new_block[grows], block_size)
    if plan.earlier is None:
        return SegmentPlan(own, None)
    return SegmentPlan(own, plan.earlier, plan.merge_starts, plan.merge_entries,
                       _longer(plan.joint, n, grows, new_block[grows], block_size))


def _longer(rows: FlashRows, n: int, grows: np.ndarray, new_block: np.ndarray,
            block_size: int) -> FlashRows:
    """`rows` with its first n rows (the requests' own, in request order) one key longer,
    rows `grows` reading `new_block` after their last block."""
    key_lens = rows.seqused_k.numpy().astype(np.int64)
    table = rows.row_blocks.numpy()
    filled = -(-key_lens[grows] // block_size)  # blocks each growing row reads now
    if grows.size and filled.max() >= table.shape[1]:
        table = np.pad(table, ((0, 0), (0, filled.max() + 1 - table.shape[1])))
    else:
        table = table.copy()
    table[grows, filled] = new_block
    key_lens[:n] += 1
    return dataclasses.replace(rows, seqused_k=torch.from_numpy(key_lens.astype(np.int32)),
                               row_blocks=torch.from_numpy(table),
                               max_seqlen_k=int(key_lens.max()))


def _joined(own: "_RowParts", earlier: "_RowParts") -> "_RowParts":
    """`own` then `earlier` as the rows of one call (their row tokens in that order)."""
    width = max(own.row_blocks.shape[1], earlier.row_blocks.shape[1])
    table = np.zeros((own.row_blocks.shape[0] + earlier.row_blocks.shape[0], width), np.int64)
    table[: own.row_blocks.shape[0], : own.row_blocks.shape[1]] = own.row_blocks
    table[own.row_blocks.shape[0]:, : earlier.row_blocks.shape[1]] = earlier.row_blocks
    return _RowParts(*(np.concatenate([a, b]) for a, b in zip(own[:-1], earlier[:-1])), table)


class _RowParts(NamedTuple):
    """A FlashRows call's arrays, on the host, as `_rows` takes them."""

    query_index: np.ndarray
    query_turn: np.ndarray
    query_lens: np.ndarray
    key_lens: np.ndarray
    row_request: np.ndarray
    row_blocks: np.ndarray


class _QueryRuns:
    """The batch's query runs: per request, its query positions split where a block
    starts a new segment (another span, frame or link shift). Run n is request
    `request[n]`'s positions [first[n], end[n]) in the segment starting at block
    `segment[n]`; its query tokens in the batch start at `token[n]`. numpy arrays: a
    plan is a few dozen operations on small arrays, where numpy's per-call cost is a
    fraction of torch's."""

    def __init__(self, layout: SpanLayout, query_start_loc: list[int], seq_lens: list[int],
                 block_size: int) -> None:
        self.block_size = block_size
        tables = _layout_tables(layout)
        self.span_of, self.context = tables.span_of, tables.context
        self.frame, self.shift = tables.frame, tables.shift
        self.span_id, self.links_end, self.link_tokens = (
            tables.span_id, tables.links_end, tables.link_tokens)
        self.block, starts_segment, segment_of = (tables.block, tables.starts_segment,
                                                  tables.segment_of)
        reqs = self.span_of.shape[0]
        qsl = np.asarray(query_start_loc[: reqs + 1], dtype=np.int64)
        seq = np.asarray(seq_lens[:reqs], dtype=np.int64)
        start = seq - (qsl[1:] - qsl[:-1])  # each request's first query position
        first_block, last_block = start // block_size, (seq - 1) // block_size
        in_queries = (self.block >= first_block[:, None]) & (self.block <= last_block[:, None])
        heads = in_queries & (starts_segment | (self.block == first_block[:, None]))
        self.request, head_block = np.nonzero(heads)  # by request, then block
        r = self.request
        self.first = np.maximum(head_block * block_size, start[r])
        follows = np.zeros(r.size, dtype=bool)
        follows[:-1] = r[1:] == r[:-1]  # the next run is the same request's
        self.end = np.where(follows, np.roll(self.first, -1), seq[r])
        self.segment = segment_of[r, head_block]
        self.token = qsl[r] + self.first - start[r]
        self.length = self.end - self.first

    def key_turns(self) -> np.ndarray:
        """[runs, blocks]: how far each run's queries are turned back to score each block's
        keys: the block's frame offset (keys read where they stand), plus link_tokens for
        keys before the links when the run is past them (links take no room)."""
        r = self.request
        links_end = self.links_end[r]
        past = (links_end > 0) & (self.first >= links_end)
        before = self.block[None, :] * self.block_size < links_end[:, None]
        return self.frame[r] + np.where(past[:, None] & before, self.link_tokens[r][:, None], 0)

    def link_shift(self) -> np.ndarray:
        """[runs]: the link shift of each run's queries (0 outside links)."""
        return self.shift[self.request, self.segment]

    def own_turn(self, turn: np.ndarray) -> np.ndarray:
        return turn[np.arange(turn.shape[0]), self.segment]

    def earlier_visible(self) -> np.ndarray:
        """[runs, blocks]: the blocks before each run's segment that its queries see, whole
        (see span_layout): none for a span's queries (a span sees itself only), else every
        block whose logical position comes before the segment's (a link's carried head
        is HIDDEN)."""
        r, segment = self.request, self.segment
        context = self.context[r]
        outside_spans = self.span_of[r, segment] < 0
        here = context[np.arange(r.size), segment]
        return ((self.block[None, :] < segment[:, None]) & outside_spans[:, None]
                & (context < here[:, None]))

    def own_rows(self, same_frame: np.ndarray, turn: np.ndarray) -> _RowParts:
        """One causal row per run: the earlier blocks in its own frame, then its segment
        up to its last query (every query token once, in batch order)."""
        last = (self.end - 1) // self.block_size
        own = ((self.block[None, :] >= self.segment[:, None])
               & (self.block[None, :] <= last[:, None]))
        key_lens = same_frame.sum(axis=1) * self.block_size + self.end \
            - self.segment * self.block_size
        return _RowParts(np.arange(self.length.sum()), np.repeat(self.own_turn(turn), self.length),
                         self.length, key_lens, self.request, _packed_table(same_frame | own))

    def earlier_rows(self, other_frames: np.ndarray, turn: np.ndarray) -> _RowParts | None:
        """One non-causal row per (run, frame) among the earlier visible blocks in frames
        other than the run's own, the run's queries turned back by that frame's turn."""
        run, block = np.nonzero(other_frames)  # by run, then block
        if run.size == 0:
            return None
        turns = turn[other_frames]  # the same order as nonzero's
        # A row per stretch of one run's blocks in one frame (a cached span's tail): any
        # split of a run's keys into rows is exact, the merge sums them.
        new_row = np.ones(run.size, dtype=bool)
        new_row[1:] = (run[1:] != run[:-1]) | (turns[1:] != turns[:-1])
        heads = np.flatnonzero(new_row)
        counts = np.diff(heads, append=run.size)
        table = _filled_rows(counts, block)
        row_run = run[heads]
        lengths = self.length[row_run]
        offsets = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        rows = _RowParts(np.repeat(self.token[row_run], lengths) + offsets,
                         np.repeat(turns[heads], lengths), lengths, counts * self.block_size,
                         self.request[row_run], table)
        if self.span_id is None:
            return rows
        # A row's id: its last block's, when its first block has one too and lies in the same
        # span (a stretch of one frame is one span's blocks today; the check keeps it so).
        request, first, last = rows.row_request, block[heads], block[heads + counts - 1]
        one_span = ((self.span_id[request, first] != NO_ID)
                    & (self.span_of[request, first] == self.span_of[request, last]))
        return _shared(rows, np.where(one_span, self.span_id[request, last], NO_ID))


def _shared(rows: _RowParts, last_span_id: np.ndarray) -> _RowParts:
    """Rows that read the same keys as one row holding all their queries.

    Two rows read the same keys when their last blocks have one span id (the same tokens
    from the span's SSep block on, so the same keys in the same frame: span_identity.py)
    and they are as long (the same blocks of that span). The row of the first request
    stands for them all; each query keeps its own turn (its distance to the span's start
    in its own prompt). A decode batch over shared documents then reads each document once
    per layer, not once per request."""
    count = rows.row_request.size
    # rows without a span id get a key of their own (negative ids): never shared
    ids = np.where(last_span_id != NO_ID, last_span_id, -1 - np.arange(count))
    _, first, group = np.unique(np.stack([ids, rows.key_lens], axis=1), axis=0,
                                return_index=True, return_inverse=True)
    if first.size == count:
        return rows
    # groups in the order of their first row (np.unique sorts them by key)
    by_first = np.argsort(first)
    rank = np.empty_like(by_first)
    rank[by_first] = np.arange(by_first.size)
    group, first = rank[group.reshape(-1)], first[by_first]
    order = np.argsort(np.repeat(group, rows.query_lens), kind="stable")
    return _RowParts(rows.query_index[order], rows.query_turn[order],
                     np.bincount(group, weights=rows.query_lens).astype(np.int64),
                     rows.key_lens[first], rows.row_request[first], rows.row_blocks[first])


class _LayoutTables(NamedTuple):
    """A layout's tables as numpy, and where its segments start: what a plan needs of the
    layout alone (a decode step's layout is the previous step's: see span_layout's cache)."""

    span_of: np.ndarray
    context: np.ndarray
    frame: np.ndarray
    shift: np.ndarray
    span_id: np.ndarray | None
    links_end: np.ndarray
    link_tokens: np.ndarray
    block: np.ndarray
    starts_segment: np.ndarray  # [reqs, blocks]: a block where another segment starts
    segment_of: np.ndarray  # [reqs, blocks]: the block starting each block's segment


def _layout_tables(layout: SpanLayout) -> _LayoutTables:
    """`layout`'s _LayoutTables, computed once while its tables stay the same tensors."""
    used = (layout.span_of, layout.context_pos, layout.frame_offset, layout.shift,
            layout.span_id, layout.links_end, layout.link_tokens)
    found = layout.derived.get("tables")
    if found is not None and all(a is b for a, b in zip(found[0], used)):
        return found[1]
    span_of, frame, shift = _host(layout.span_of), _host(layout.frame_offset), _host(layout.shift)
    reqs, blocks = span_of.shape
    block = np.arange(blocks)
    starts_segment = np.ones((reqs, blocks), dtype=bool)
    starts_segment[:, 1:] = ((span_of[:, 1:] != span_of[:, :-1]) | (frame[:, 1:] != frame[:, :-1])
                             | (shift[:, 1:] != shift[:, :-1]))
    tables = _LayoutTables(
        span_of, _host(layout.context_pos), frame, shift,
        None if layout.span_id is None else _host(layout.span_id),
        np.zeros(reqs, np.int64) if layout.links_end is None else _host(layout.links_end),
        np.zeros(reqs, np.int64) if layout.link_tokens is None else _host(layout.link_tokens),
        block, starts_segment,
        np.maximum.accumulate(np.where(starts_segment, block, 0), axis=1))
    layout.derived["tables"] = (used, tables)  # the tensors themselves: no id reuse
    return tables


def _host(t: torch.Tensor) -> np.ndarray:
    return t.numpy().astype(np.int64)


def _packed_table(taken: np.ndarray) -> np.ndarray:
    """[rows, width]: each row's taken blocks, in order, then zeros."""
    blocks = np.broadcast_to(np.arange(taken.shape[1]), taken.shape)[taken]
    return _filled_rows(taken.sum(axis=1), blocks)


def _filled_rows(counts: np.ndarray, values: np.ndarray) -> np.ndarray:
    """[rows, max(counts)]: row i holds the next counts[i] of `values`, then zeros (a
    boolean mask fills in row order: no index arithmetic per value)."""
    table = np.zeros((counts.size, counts.max()), dtype=np.int64)
    table[np.arange(table.shape[1]) < counts[:, None]] = values
    return table


def _rows(query_index: np.ndarray, query_turn: np.ndarray, query_lens: np.ndarray,
          key_lens: np.ndarray, row_request: np.ndarray, row_blocks: np.ndarray) -> FlashRows:
    cu = np.zeros(query_lens.size + 1, dtype=np.int32)
    cu[1:] = np.cumsum(query_lens)
    return FlashRows(query_index=torch.from_numpy(query_index.astype(np.int64)),
                     query_turn=torch.from_numpy(query_turn.astype(np.int32)),
                     cu_seqlens_q=torch.from_numpy(cu),
                     seqused_k=torch.from_numpy(key_lens.astype(np.int32)),
                     row_request=torch.from_numpy(row_request.astype(np.int64)),
                     row_blocks=torch.from_numpy(row_blocks),
                     max_seqlen_q=int(query_lens.max()), max_seqlen_k=int(key_lens.max()))
