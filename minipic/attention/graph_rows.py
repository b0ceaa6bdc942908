"""Worker side (CUDA, Model Runner V2): a step's FlashAttention rows in buffers of a fixed
capacity, so that vLLM captures the whole step in one CUDA graph. Two kinds of step:
  * a uniform decode step of B requests (vLLM's own full decode graphs);
  * a short prefill of one request, B query tokens (a span hit's question: minipic's
    prefill graphs, graph_dispatch.py). Its plan's own rows are one query each
    (segment_plan._joint), so it is laid out as a decode step of B one-query rows.

vLLM captures a full graph per batch size and replays it at every step of that size: the
replay reads the same device buffers at the same shapes whatever the batch (vLLM's own
FlashAttention metadata works so). A batch's rows (segment_plan.py) change with its
prompts, so they are written into buffers sized for the captured size B:
  * rows: B own rows (query i's in row i; a padding query's has no keys), then the
    plan's earlier rows, then empty rows up to the capacity;
  * row tokens: the B queries, then the earlier rows' tokens, then padding that no row
    holds (the turn skips it: `rows_in_use`).
FlashAttention skips empty rows, and the merge reads only the entries the plan gives.
A batch without spans, and one needing more earlier row tokens than
earlier_capacity(B, kind), runs without the full graph (graph_dispatch.py). A plain batch
here (a capture, a dummy run) is its own rows alone, turned by 0.

Memory: the row tables are int32 [rows, max_model_len / block_size] per builder, rows the
larger of the two kinds' largest B plus the larger of their earlier capacities (17 MB at
256 requests and 8k tokens, 554 MB at 512 and 128k; prefill graphs, at most 128 tokens,
hold 8192 earlier row tokens, as many as decode graphs of 256 requests: 273 MB at 16
requests and 128k), made at the first capture, after vLLM sized the KV cache: they come
out of its headroom.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
import torch

from minipic.attention.host_copy import to_device
from minipic.attention.rotation import Rotation
from minipic.attention.segment_attention import SegmentBatch
from minipic.attention.segment_plan import FlashRows, SegmentPlan

# Earlier row tokens a graph holds: this many per own row, at most GRAPH_EARLIER_TOKENS_MAX
# (the turned queries and FlashAttention's output are [tokens, heads, head_size] each). A
# decode query reads a few rows (its documents shared with other requests'); a question
# reads one row per document before it: 64 holds a question over 64 documents.
GRAPH_EARLIER_TOKENS_PER_REQUEST = 32
GRAPH_EARLIER_TOKENS_PER_QUESTION_TOKEN = 64
GRAPH_EARLIER_TOKENS_MAX = 32768


def earlier_capacity(rows: int, prefill: bool = False) -> int:
    """Earlier row tokens of a graph of `rows` own rows: a decode graph's (rows requests)
    or, `prefill`, a prefill graph's (one request, rows query tokens)."""
    per_row = (GRAPH_EARLIER_TOKENS_PER_QUESTION_TOKEN if prefill
               else GRAPH_EARLIER_TOKENS_PER_REQUEST)
    return min(rows * per_row, GRAPH_EARLIER_TOKENS_MAX)


class GraphShape(NamedTuple):
    """A captured graph's batch: `rows` own rows, one query each (a decode graph's
    requests, or a prefill graph's query tokens), and the earlier row tokens it holds."""

    rows: int
    prefill: bool = False

    @property
    def earlier(self) -> int:
        return earlier_capacity(self.rows, self.prefill)

    @property
    def tokens(self) -> int:  # row tokens, as many as rows at most
        return self.rows + self.earlier


class GraphRows:
    """One metadata builder's persistent row buffers, for decode graphs of up to `max_reqs`
    requests and prefill graphs of up to `max_prefill` query tokens."""

    def __init__(self, max_reqs: int, max_prefill: int, table_width: int, max_seqlen_k: int,
                 rotary_dim: int, is_neox_style: bool, device: torch.device) -> None:
        self.max_seqlen_k = max_seqlen_k
        self.rotary_dim, self.is_neox_style = rotary_dim, is_neox_style
        largest = (GraphShape(max_reqs), GraphShape(max_prefill, prefill=True))
        own = max(shape.rows for shape in largest)
        earlier = max(shape.earlier for shape in largest)
        rows = own + earlier  # rows <= row tokens
        half = rotary_dim // 2

        def ints(*shape, dtype=torch.int32):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.cu_seqlens_q, self.seqused_k = ints(rows + 1), ints(rows)
        self.table = ints(rows, table_width)
        self.query_index = ints(rows, dtype=torch.int64)
        self.rows_in_use = ints(1)  # row tokens in use: the turn's programs past it stop
        self.merge_starts, self.merge_entries = ints(own + 1), ints(earlier)
        self.cos = torch.ones(rows, half, dtype=torch.float32, device=device)
        self.sin = torch.zeros(rows, half, dtype=torch.float32, device=device)
        self.key_cos = torch.ones(own, half, dtype=torch.float32, device=device)
        self.key_sin = torch.zeros(own, half, dtype=torch.float32, device=device)

    def fill(self, shape: GraphShape, plan: SegmentPlan | None, seq_lens: list[int],
             key_turns: torch.Tensor | None, block_table: torch.Tensor, block_size: int,
             cos_sin: torch.Tensor) -> tuple[SegmentBatch, Rotation]:
        """The batch written into the buffers at the graph's `shape`: its rows (`plan` on
        the host, whose own rows are one query each; None for a plain batch of
        len(seq_lens) decode requests) and its new keys' turns (`key_turns` [real tokens]
        on the host, None: all 0). Returns the SegmentBatch and the key Rotation over the
        buffers, for every step."""
        own, earlier = self.key_cos.shape[0], self.merge_entries.numel()
        if shape.rows > own or shape.earlier > earlier:
            raise RuntimeError(f"minipic: a CUDA graph of {shape} is larger than the row "
                               f"buffers ({own} own rows, {earlier} earlier row tokens)")
        host = _graph_rows(shape, plan, seq_lens, key_turns, block_table.shape[1], block_size)
        self._write(host, block_table, cos_sin)
        return self._batch(shape), Rotation(self.key_cos[: shape.rows],
                                            self.key_sin[: shape.rows], self.rotary_dim,
                                            self.is_neox_style)

    def _write(self, host: "_GraphRows", block_table: torch.Tensor, cos_sin: torch.Tensor) -> None:
        """The host arrays to the buffers: one copy per dtype, then device copies."""
        device = self.table.device
        small = [host.cu_seqlens_q, host.seqused_k, host.merge_starts, host.merge_entries,
                 host.turn, host.key_turn, host.rows_in_use]
        moved = to_device(torch.from_numpy(np.concatenate(small)), device).split(
            [a.size for a in small])
        cu, seqused, starts, entries, turn, key_turn, rows_in_use = moved
        index = to_device(torch.from_numpy(np.concatenate(
            [host.query_index, host.row_request, host.row_blocks.reshape(-1)])), device)
        query_index, row_request, row_blocks = index.split(
            [host.query_index.size, host.row_request.size, host.row_blocks.size])
        self.cu_seqlens_q[: cu.numel()].copy_(cu)
        self.seqused_k[: seqused.numel()].copy_(seqused)
        self.merge_starts[: starts.numel()].copy_(starts)
        self.merge_entries[: entries.numel()].copy_(entries)
        self.query_index[: query_index.numel()].copy_(query_index)
        self.rows_in_use.copy_(rows_in_use)
        rows, width = host.row_blocks.shape
        if rows and width:  # rows past them keep stale blocks: they read no keys
            self.table[:rows, :width].copy_(
                block_table[row_request[:, None], row_blocks.view(rows, width)])
        rotation = Rotation.back(turn, cos_sin, self.rotary_dim, self.is_neox_style)
        self.cos[: turn.numel()].copy_(rotation.cos)
        self.sin[: turn.numel()].copy_(rotation.sin)
        keys = Rotation.back(key_turn, cos_sin, self.rotary_dim, self.is_neox_style)
        self.key_cos[: key_turn.numel()].copy_(keys.cos)
        self.key_sin[: key_turn.numel()].copy_(keys.sin)

    def _batch(self, shape: GraphShape) -> SegmentBatch:
        """The buffers as a SegmentBatch of one joint call at the graph's fixed shapes."""
        rows, tokens = shape.rows, shape.tokens
        joint = FlashRows(query_index=self.query_index[:tokens], query_turn=None,
                          cu_seqlens_q=self.cu_seqlens_q[: tokens + 1],
                          seqused_k=self.seqused_k[:tokens], row_request=None, row_blocks=None,
                          max_seqlen_q=rows, max_seqlen_k=self.max_seqlen_k)
        # what the torch merge (tests) reads of the earlier rows: each row token's query
        earlier = dataclasses.replace(joint, query_index=self.query_index[rows:tokens])
        plan = SegmentPlan(joint, earlier, self.merge_starts[: rows + 1],
                           self.merge_entries[: shape.earlier], joint)
        turn = Rotation(self.cos[:tokens], self.sin[:tokens], self.rotary_dim, self.is_neox_style)
        # No launch cache: it would hold its last layer's tensors (the turned queries,
        # FlashAttention's output: 16.5 kB a row token on an 8B model) while vLLM keeps the
        # metadata, every graph's through the whole capture, and the graph pool keeps what
        # a capture held. A replay launches nothing from Python.
        return SegmentBatch(plan, None, None, self.table[:tokens], self.query_index[:tokens],
                            turn, True, self.rotary_dim, self.is_neox_style,
                            turn_count=self.rows_in_use, launches=None)


@dataclasses.dataclass
class _GraphRows:
    """A graph batch's arrays on the host (int32 but the int64 indexes)."""

    cu_seqlens_q: np.ndarray
    seqused_k: np.ndarray
    merge_starts: np.ndarray
    merge_entries: np.ndarray
    turn: np.ndarray
    key_turn: np.ndarray
    rows_in_use: np.ndarray
    query_index: np.ndarray  # int64
    row_request: np.ndarray  # int64
    row_blocks: np.ndarray  # int64 [rows written, width]


def _graph_rows(shape: GraphShape, plan: SegmentPlan | None, seq_lens: list[int],
                key_turns: torch.Tensor | None, table_width: int, block_size: int
                ) -> _GraphRows:
    """The plan's rows in the graph's order: B own rows, the earlier rows, empty rows."""
    rows, n = _one_query_rows(plan, seq_lens, table_width, block_size)
    b, capacity, tokens = shape.rows, shape.earlier, shape.tokens  # tokens: as many rows
    cu = rows.cu_seqlens_q.numpy().astype(np.int64)
    earlier_rows, earlier_tokens = rows.seqused_k.numel() - n, int(cu[-1]) - n
    if n > b or earlier_tokens > capacity:
        raise RuntimeError(
            f"minipic: a batch of {n} queries needing {earlier_tokens} earlier row tokens "
            f"does not fit the CUDA graph of {b} ({capacity}); the dispatch check sends "
            "such batches to the piecewise graphs")
    graph_cu = np.full(tokens + 1, b + earlier_tokens, dtype=np.int32)
    graph_cu[: b + 1] = np.arange(b + 1)
    graph_cu[b: b + earlier_rows + 1] = b + cu[n:] - n
    seqused = np.zeros(tokens, dtype=np.int32)
    seqused[:n] = rows.seqused_k[:n].numpy()
    seqused[b: b + earlier_rows] = rows.seqused_k[n:].numpy()
    index = np.zeros(tokens, dtype=np.int64)  # the padding's: in range, never read
    index[:b] = np.arange(b)
    index[b: b + earlier_tokens] = rows.query_index[n:].numpy()
    turn = np.zeros(tokens, dtype=np.int32)
    turn[:n] = rows.query_turn[:n].numpy()
    turn[b: b + earlier_tokens] = rows.query_turn[n:].numpy()
    starts = np.full(b + 1, earlier_tokens, dtype=np.int32)
    entries = np.zeros(capacity, dtype=np.int32)
    if plan is not None and plan.earlier is not None:
        starts[: n + 1] = plan.merge_starts.numpy()
        entries[:earlier_tokens] = plan.merge_entries.numpy()
    key_turn = np.zeros(b, dtype=np.int32)
    if key_turns is not None:
        key_turn[:n] = key_turns.numpy()
    # the physical tables: own rows, padding rows (block 0 of request 0, never read), earlier
    request = np.zeros(b + earlier_rows, dtype=np.int64)
    request[:n] = rows.row_request[:n].numpy()
    request[b:] = rows.row_request[n:].numpy()
    blocks = np.zeros((request.size, rows.row_blocks.shape[1]), dtype=np.int64)
    blocks[:n] = rows.row_blocks[:n].numpy()
    blocks[b:] = rows.row_blocks[n:].numpy()
    rows_in_use = np.array([b + earlier_tokens], dtype=np.int32)
    return _GraphRows(graph_cu, seqused, starts, entries, turn, key_turn, rows_in_use, index,
                      request, blocks)


def _one_query_rows(plan: SegmentPlan | None, seq_lens: list[int], table_width: int,
                    block_size: int) -> tuple[FlashRows, int]:
    """The batch's rows as one call, its n own rows first, one query each, and n: the
    plan's joint rows (a prefill's own rows go one query each there too) or its own rows
    (a decode batch's, without earlier rows); a plain decode batch's own rows (each
    request's blocks in order, turned by 0)."""
    n = len(seq_lens)
    if plan is not None:
        rows = plan.joint if plan.earlier is not None else plan.own
        n = plan.own.query_index.numel()
        if rows is None or rows.cu_seqlens_q.numel() < n + 1 \
                or rows.cu_seqlens_q[n].item() != n:
            raise ValueError("a graph's batch runs its own rows one query each")
        return rows, n
    lens = np.asarray(seq_lens, dtype=np.int64)
    width = min(table_width, -(-int(lens.max()) // block_size) if n else 0)
    rows = FlashRows(query_index=torch.arange(n), query_turn=torch.zeros(n, dtype=torch.int32),
                     cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32),
                     seqused_k=torch.from_numpy(lens.astype(np.int32)),
                     row_request=torch.arange(n),
                     row_blocks=torch.arange(width).expand(n, width), max_seqlen_q=1,
                     max_seqlen_k=int(lens.max()) if n else 0)
    return rows, n
