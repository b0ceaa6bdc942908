"""Worker side (CUDA, Model Runner V2): a decode step's FlashAttention rows in buffers of a
fixed capacity, so that vLLM captures the whole step in one CUDA graph.

vLLM captures a full graph per decode batch size and replays it at every uniform
decode step of that size: the replay reads the same device buffers at the same shapes
whatever the batch (vLLM's own FlashAttention metadata works so). A decode batch's rows
(segment_plan.py) change with its prompts, so they are written into buffers sized for
the captured batch size B:
  * rows: B own rows (request i's in row i; a padding request's has no keys), then the
    plan's earlier rows, then empty rows up to the capacity;
  * row tokens: the B queries, then the earlier rows' tokens, then padding that no row
    holds (the turn skips it: `rows_in_use`).
FlashAttention skips empty rows, and the merge reads only the entries the plan gives.
A batch without spans, and one needing more earlier row tokens than earlier_capacity(B),
runs without the full graph (decode_dispatch.py). A plain batch here (a capture, a dummy
run) is its own rows alone, turned by 0.

Memory: the row tables are int32 [max_reqs + earlier_capacity(max_reqs), max_model_len /
block_size] per builder (17 MB at 256 requests and 8k tokens, 554 MB at 512 and 128k), made at
the first capture, after vLLM sized the KV cache: they come out of its headroom.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from minipic.attention.host_copy import to_device
from minipic.attention.rotation import Rotation
from minipic.attention.segment_attention import SegmentBatch
from minipic.attention.segment_plan import FlashRows, SegmentPlan

# Earlier row tokens a graph holds: this many per request, at most GRAPH_EARLIER_TOKENS_MAX
# (the turned queries and FlashAttention's output are [tokens, heads, head_size] each).
GRAPH_EARLIER_TOKENS_PER_REQUEST = 32
GRAPH_EARLIER_TOKENS_MAX = 32768


def earlier_capacity(num_reqs: int) -> int:
    return min(num_reqs * GRAPH_EARLIER_TOKENS_PER_REQUEST, GRAPH_EARLIER_TOKENS_MAX)


class DecodeGraphRows:
    """One metadata builder's persistent row buffers, for batches of up to `max_reqs`."""

    def __init__(self, max_reqs: int, table_width: int, max_seqlen_k: int, rotary_dim: int,
                 is_neox_style: bool, device: torch.device) -> None:
        self.max_seqlen_k = max_seqlen_k
        self.rotary_dim, self.is_neox_style = rotary_dim, is_neox_style
        rows = max_reqs + earlier_capacity(max_reqs)  # rows <= row tokens
        half = rotary_dim // 2

        def ints(*shape, dtype=torch.int32):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.cu_seqlens_q, self.seqused_k = ints(rows + 1), ints(rows)
        self.table = ints(rows, table_width)
        self.query_index = ints(rows, dtype=torch.int64)
        self.rows_in_use = ints(1)  # row tokens in use: the turn's programs past it stop
        self.merge_starts, self.merge_entries = ints(max_reqs + 1), ints(earlier_capacity(max_reqs))
        self.cos = torch.ones(rows, half, dtype=torch.float32, device=device)
        self.sin = torch.zeros(rows, half, dtype=torch.float32, device=device)
        self.key_cos = torch.ones(max_reqs, half, dtype=torch.float32, device=device)
        self.key_sin = torch.zeros(max_reqs, half, dtype=torch.float32, device=device)

    def fill(self, num_reqs: int, plan: SegmentPlan | None, seq_lens: list[int],
             key_turns: torch.Tensor | None, block_table: torch.Tensor, block_size: int,
             cos_sin: torch.Tensor) -> tuple[SegmentBatch, Rotation]:
        """The batch of B = num_reqs tokens (its first len(seq_lens) real, one query each)
        written into the buffers: its rows (`plan` on the host; None for a plain batch)
        and its new keys' turns (`key_turns` [real tokens] on the host, None: all 0).
        Returns the SegmentBatch and the key Rotation over the buffers, for every step."""
        host = _graph_rows(num_reqs, plan, seq_lens, key_turns, block_table.shape[1],
                           block_size)
        self._write(host, block_table, cos_sin)
        return self._batch(num_reqs), Rotation(self.key_cos[:num_reqs], self.key_sin[:num_reqs],
                                               self.rotary_dim, self.is_neox_style)

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

    def _batch(self, num_reqs: int) -> SegmentBatch:
        """The buffers as a SegmentBatch of one joint call at the graph's fixed shapes."""
        tokens = num_reqs + earlier_capacity(num_reqs)
        joint = FlashRows(query_index=self.query_index[:tokens], query_turn=None,
                          cu_seqlens_q=self.cu_seqlens_q[: tokens + 1],
                          seqused_k=self.seqused_k[:tokens], row_request=None, row_blocks=None,
                          max_seqlen_q=num_reqs, max_seqlen_k=self.max_seqlen_k)
        # what the torch merge (tests) reads of the earlier rows: each row token's query
        earlier = dataclasses.replace(joint, query_index=self.query_index[num_reqs:tokens])
        plan = SegmentPlan(joint, earlier, self.merge_starts[: num_reqs + 1],
                           self.merge_entries[: earlier_capacity(num_reqs)], joint)
        turn = Rotation(self.cos[:tokens], self.sin[:tokens], self.rotary_dim, self.is_neox_style)
        return SegmentBatch(plan, None, None, self.table[:tokens], self.query_index[:tokens],
                            turn, True, self.rotary_dim, self.is_neox_style,
                            turn_count=self.rows_in_use)


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


def _graph_rows(num_reqs: int, plan: SegmentPlan | None, seq_lens: list[int],
                key_turns: torch.Tensor | None, table_width: int, block_size: int
                ) -> _GraphRows:
    """The plan's rows in the graph's order: B own rows, the earlier rows, empty rows."""
    n = len(seq_lens)
    rows = _decode_rows(plan, seq_lens, table_width, block_size)
    cu = rows.cu_seqlens_q.numpy().astype(np.int64)
    earlier_rows, earlier_tokens = rows.seqused_k.numel() - n, int(cu[-1]) - n
    capacity = earlier_capacity(num_reqs)
    if n > num_reqs or earlier_tokens > capacity:
        raise RuntimeError(
            f"minipic: a decode batch of {n} requests needing {earlier_tokens} earlier row "
            f"tokens does not fit the CUDA graph of {num_reqs} ({capacity}); the dispatch "
            "check sends such batches to the piecewise graphs")
    tokens = num_reqs + capacity  # as many rows as row tokens
    graph_cu = np.full(tokens + 1, num_reqs + earlier_tokens, dtype=np.int32)
    graph_cu[: num_reqs + 1] = np.arange(num_reqs + 1)
    graph_cu[num_reqs: num_reqs + earlier_rows + 1] = num_reqs + cu[n:] - n
    seqused = np.zeros(tokens, dtype=np.int32)
    seqused[:n] = rows.seqused_k[:n].numpy()
    seqused[num_reqs: num_reqs + earlier_rows] = rows.seqused_k[n:].numpy()
    index = np.zeros(tokens, dtype=np.int64)  # the padding's: in range, never read
    index[:num_reqs] = np.arange(num_reqs)
    index[num_reqs: num_reqs + earlier_tokens] = rows.query_index[n:].numpy()
    turn = np.zeros(tokens, dtype=np.int32)
    turn[:n] = rows.query_turn[:n].numpy()
    turn[num_reqs: num_reqs + earlier_tokens] = rows.query_turn[n:].numpy()
    starts = np.full(num_reqs + 1, earlier_tokens, dtype=np.int32)
    entries = np.zeros(capacity, dtype=np.int32)
    if plan is not None and plan.earlier is not None:
        starts[: n + 1] = plan.merge_starts.numpy()
        entries[:earlier_tokens] = plan.merge_entries.numpy()
    key_turn = np.zeros(num_reqs, dtype=np.int32)
    if key_turns is not None:
        key_turn[:n] = key_turns.numpy()
    # the physical tables: own rows, padding rows (block 0 of request 0, never read), earlier
    request = np.zeros(num_reqs + earlier_rows, dtype=np.int64)
    request[:n] = rows.row_request[:n].numpy()
    request[num_reqs:] = rows.row_request[n:].numpy()
    blocks = np.zeros((request.size, rows.row_blocks.shape[1]), dtype=np.int64)
    blocks[:n] = rows.row_blocks[:n].numpy()
    blocks[num_reqs:] = rows.row_blocks[n:].numpy()
    rows_in_use = np.array([num_reqs + earlier_tokens], dtype=np.int32)
    return _GraphRows(graph_cu, seqused, starts, entries, turn, key_turn, rows_in_use, index,
                      request, blocks)


def _decode_rows(plan: SegmentPlan | None, seq_lens: list[int], table_width: int,
                 block_size: int) -> FlashRows:
    """The batch's rows as one call: the plan's joint (own) rows; a plain batch's own rows
    (each request's blocks in order, turned by 0). Requests run one query each."""
    n = len(seq_lens)
    if plan is not None:
        rows = plan.joint if plan.earlier is not None else plan.own
        # n query tokens in all (a prefill's joint rows are one query each too)
        if rows is None or plan.own.query_index.numel() != n \
                or rows.cu_seqlens_q.numel() < n + 1 or rows.cu_seqlens_q[n].item() != n:
            raise ValueError("a decode graph's batch runs one query per request")
        return rows
    lens = np.asarray(seq_lens, dtype=np.int64)
    width = min(table_width, -(-int(lens.max()) // block_size) if n else 0)
    return FlashRows(query_index=torch.arange(n), query_turn=torch.zeros(n, dtype=torch.int32),
                     cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32),
                     seqused_k=torch.from_numpy(lens.astype(np.int32)),
                     row_request=torch.arange(n),
                     row_blocks=torch.arange(width).expand(n, width), max_seqlen_q=1,
                     max_seqlen_k=int(lens.max()) if n else 0)
