"""Worker side: attention of a span batch as stock FlashAttention calls (segment_plan.py).

Each call attends its rows' queries, turned back into the frame of the keys they
read, over the paged cache as it is; the calls' outputs are merged per query token by
their log-sum-exp. `flash` is vLLM's `flash_attn_varlen_func` on CUDA
(cuda_backend.py); tests pass `paged_flash_reference` to check the plan on CPU. On
CUDA the turns and the merge are one Triton launch each (segment_kernels.py); on
other devices (tests) they run in torch.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from minipic.attention.plan_groups import PlanGroup
from minipic.attention.rotation import Rotation
from minipic.attention.segment_plan import FlashRows, SegmentPlan

# flash(q, k_cache, v_cache, rows: FlashRows, block_table, causal=..., out=None) -> (out,
# lse), lse [heads, tokens]; writes `out` when given; the softmax scale bound by the caller.
Flash = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclasses.dataclass
class NewKeys:
    """A batch's new keys to turn into their frames in the same launch as its row queries
    and hand to `write` (the cache write) before attention reads the cache."""

    key: torch.Tensor  # [tokens, kv_heads, head_size]; its first turn.cos.shape[0] turn
    turn: Rotation
    write: Callable[[torch.Tensor], None]  # takes the turned keys


@dataclasses.dataclass
class SegmentBatch:
    """A plan made ready on the device once per batch, for every layer: the rows' physical
    block tables, and one rotation for all turned row queries (the own rows' first when
    any own turn is not 0 or the plan is joint, then the earlier rows'). Beside a joint
    call its own and earlier rows stay on the host (SegmentPlan.to)."""

    plan: SegmentPlan
    own_table: torch.Tensor | None  # None for a joint plan: its call reads joint_table only
    earlier_table: torch.Tensor | None
    joint_table: torch.Tensor | None
    turn_index: torch.Tensor | None  # which query token each turned row query is
    turn: Rotation | None
    own_turned: bool
    rotary_dim: int
    is_neox_style: bool
    # A full graph's batch (graph_rows.py): [1] on the device, how many of the turn's
    # rows are in use (the rest are capacity); None: all are.
    turn_count: torch.Tensor | None = None
    # The turn's and the merge's launches, bound once for every layer (CUDA:
    # segment_kernels.RepeatedLaunch); None: each launch binds its own (a full graph's
    # batch, see graph_rows.GraphRows._batch)
    launches: dict | None = dataclasses.field(default_factory=dict)


def prepare(host_plan: SegmentPlan, block_table: torch.Tensor, cos_sin: torch.Tensor,
            rotary_dim: int, is_neox_style: bool) -> SegmentBatch:
    """`host_plan` moved to the block table's device, its tables and turns looked up."""
    # on the host: no device sync. A joint call reads its queries from the turned rows only.
    own_turned = host_plan.joint is not None or bool(host_plan.own.query_turn.any())
    # Turns are frame offsets and link shifts, never negative: checked here on the host, so
    # that the device's lookup skips the sign (every device op is host time, once a batch).
    non_negative = all(rows.query_turn.numpy().min(initial=0) >= 0
                       for rows in _turned_rows(host_plan, own_turned))
    plan = host_plan.to(block_table.device)
    parts = _turned_rows(plan, own_turned)
    turn_index = turn = None
    if parts:
        turn_index = _cat([rows.query_index for rows in parts])
        turn = Rotation.back(_cat([rows.query_turn for rows in parts]), cos_sin, rotary_dim,
                             is_neox_style, non_negative=non_negative)
    return SegmentBatch(plan, *_row_tables(plan, block_table), turn_index, turn, own_turned,
                        rotary_dim, is_neox_style)


@dataclasses.dataclass
class GroupedBatch:
    """A span batch as groups of query tokens (plan_groups.py), attended one after
    another: group i's SegmentBatch reads its requests' rows of the block table."""

    groups: list[PlanGroup]
    batches: list[SegmentBatch]


def prepare_groups(groups: list[PlanGroup], block_table: torch.Tensor, cos_sin: torch.Tensor,
                   rotary_dim: int, is_neox_style: bool) -> GroupedBatch:
    """Each group's plan made ready on the block table's device (`prepare`)."""
    return GroupedBatch(groups, [
        prepare(group.plan, block_table[group.first_request: group.end_request], cos_sin,
                rotary_dim, is_neox_style) for group in groups])


def _turned_rows(plan: SegmentPlan, own_turned: bool) -> list[FlashRows]:
    """The rows whose queries are turned, in the turn's order: a joint call's (its rows
    are own's, then earlier's), else own's when they turn, then earlier's."""
    if plan.joint is not None:
        return [plan.joint]
    return ([plan.own] if own_turned else []) + (
        [plan.earlier] if plan.earlier is not None else [])


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat, but one tensor is itself (cat would copy it: a device op)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def with_block_table(batch: SegmentBatch | GroupedBatch, block_table: torch.Tensor
                     ) -> SegmentBatch | GroupedBatch:
    """The same batch over another KV cache group's block table (vLLM's
    update_block_table reuses one group's metadata for another)."""
    if isinstance(batch, GroupedBatch):
        return GroupedBatch(batch.groups, [
            with_block_table(part, block_table[group.first_request: group.end_request])
            for group, part in zip(batch.groups, batch.batches)])
    own_table, earlier_table, joint_table = _row_tables(batch.plan, block_table)
    return dataclasses.replace(batch, own_table=own_table, earlier_table=earlier_table,
                               joint_table=joint_table)


def segment_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      output: torch.Tensor, batch: SegmentBatch, flash: Flash,
                      new_keys: NewKeys | None = None) -> torch.Tensor:
    """`output` [n, heads, head_size] = attention of the batch's n query tokens `query`;
    `new_keys`, when given, are turned and written first."""
    plan, n = batch.plan, query.shape[0]
    turned, keys = _turned(query, batch, new_keys)
    if new_keys is not None:
        new_keys.write(keys)
    own_q = turned[:n] if batch.own_turned else query
    if plan.earlier is None:  # the own rows are the whole answer
        flash(own_q, key_cache, value_cache, plan.own, batch.own_table, causal=True, out=output)
        return output
    offset = 0  # where the earlier rows start in earlier_out
    if plan.joint is not None:  # one query per run: both kinds of rows in one call
        own_out, own_lse = flash(turned, key_cache, value_cache, plan.joint, batch.joint_table,
                                 causal=False)
        earlier_out, earlier_lse, offset = own_out, own_lse, n  # its own rows are the first n
    else:
        own_out, own_lse = flash(own_q, key_cache, value_cache, plan.own, batch.own_table,
                                 causal=True)
        earlier_q = turned[n:] if batch.own_turned else turned
        earlier_out, earlier_lse = flash(earlier_q, key_cache, value_cache, plan.earlier,
                                         batch.earlier_table, causal=False)
    if output.is_cuda:  # the kernel reads the earlier rows at the offset: no views to make
        from minipic.attention.segment_kernels import merge_rows

        return merge_rows(output, own_out, own_lse, earlier_out, earlier_lse,
                          plan.merge_starts, plan.merge_entries, batch.launches,
                          earlier_offset=offset)
    return merge(output, own_out[:n], own_lse[:, :n], earlier_out[offset:],
                 earlier_lse[:, offset:], plan.earlier.query_index)


def grouped_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      output: torch.Tensor, batch: GroupedBatch, flash: Flash,
                      new_keys: NewKeys | None = None) -> torch.Tensor:
    """`segment_attention` of each group's query tokens in turn; the first group's call
    writes every new key of the batch (later groups read them from the cache)."""
    for group, part in zip(batch.groups, batch.batches):
        tokens = slice(group.first_token, group.end_token)
        segment_attention(query[tokens], key_cache, value_cache, output[tokens], part, flash,
                          new_keys)
        new_keys = None
    return output


def _turned(query: torch.Tensor, batch: SegmentBatch, new_keys: NewKeys | None
            ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The turned row queries (None when none turn) and the turned new keys (None without
    them): one launch on CUDA."""
    keys = None if new_keys is None else new_keys.key[: new_keys.turn.cos.shape[0]]
    if not query.is_cuda:
        turned = None if batch.turn is None else batch.turn.apply(
            query.index_select(0, batch.turn_index)).to(query.dtype)
        return turned, None if keys is None else new_keys.turn.apply(keys).to(keys.dtype)
    from minipic.attention.segment_kernels import turn_rows, turn_rows_and_keys

    if batch.turn is None:
        turned_keys = None if keys is None else turn_rows(
            keys, None, new_keys.turn.cos, new_keys.turn.sin, new_keys.turn.rotary_dim,
            new_keys.turn.is_neox_style, batch.launches)
        return None, turned_keys
    key_turn = () if keys is None else (keys, new_keys.turn.cos, new_keys.turn.sin)
    return turn_rows_and_keys(query, batch.turn_index, batch.turn.cos, batch.turn.sin,
                              batch.rotary_dim, batch.is_neox_style, *key_turn,
                              row_count=batch.turn_count, launches=batch.launches)


def merge(output: torch.Tensor, own_out: torch.Tensor, own_lse: torch.Tensor,
          earlier_out: torch.Tensor, earlier_lse: torch.Tensor,
          token: torch.Tensor) -> torch.Tensor:
    """output [n, heads, d] = the softmax-weighted merge of each token's own row and its
    earlier rows (`token` [m]: the query token of each earlier row token), in fp32
    torch (what segment_kernels.merge_rows computes in one launch)."""
    heads = own_lse.shape[0]
    # a row without keys: FA3 gives its LSE as -inf, FA2 as +inf (no weight either way)
    own_lse, earlier_lse = (torch.where(lse == float("inf"), float("-inf"), lse.float())
                            for lse in (own_lse, earlier_lse))
    peak = own_lse.clone()
    peak.scatter_reduce_(1, token[None].expand(heads, -1), earlier_lse, "amax")
    # a token without keys (graph padding) gets 0
    peak = torch.where(peak == float("-inf"), 0.0, peak)
    own_weight = torch.exp(own_lse - peak)  # [heads, n]
    earlier_weight = torch.exp(earlier_lse - peak[:, token])  # [heads, m]
    total = own_out.float() * own_weight.t()[..., None]
    total.index_add_(0, token, earlier_out.float() * earlier_weight.t()[..., None])
    norm = own_weight.index_add(1, token, earlier_weight)
    output.copy_(total / norm.clamp(min=torch.finfo(torch.float32).tiny).t()[..., None])
    return output


def vllm_flash_rows(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    rows: FlashRows, block_table: torch.Tensor, causal: bool, *, scale: float,
                    fa_version: int, out: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """One FlashRows call of vLLM's own FlashAttention (CUDA): the `flash` of
    segment_attention, with the scale and version bound by the caller."""
    from vllm.v1.attention.backends.flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(
        q=q, k=key_cache, v=value_cache, cu_seqlens_q=rows.cu_seqlens_q,
        max_seqlen_q=rows.max_seqlen_q, seqused_k=rows.seqused_k,
        max_seqlen_k=rows.max_seqlen_k, softmax_scale=scale, causal=causal,
        block_table=block_table, return_softmax_lse=True, fa_version=fa_version, out=out)


def _row_tables(plan: SegmentPlan, block_table: torch.Tensor) -> tuple:
    """The physical tables of the plan's own, earlier and joint rows (None where absent or,
    beside a joint call, unused)."""
    if plan.joint is not None:
        return None, None, _row_table(block_table, plan.joint)
    return (_row_table(block_table, plan.own),
            None if plan.earlier is None else _row_table(block_table, plan.earlier), None)


def _row_table(block_table: torch.Tensor, rows: FlashRows) -> torch.Tensor:
    """[rows, width] physical blocks of each row (its request's, in the row's order)."""
    return block_table[rows.row_request[:, None], rows.row_blocks].to(torch.int32)


def paged_flash_reference(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          rows: FlashRows, block_table: torch.Tensor, causal: bool,
                          scale: float, out: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """What `flash_attn_varlen_func(..., return_softmax_lse=True)` computes, in fp32 torch:
    caches [blocks, block_size, kv_heads, d]; causal aligned to the bottom right."""
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    heads = q.shape[1]
    result = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    # tokens in no row (a graph batch's padding) stand at -inf: no weight in the merge
    lse = torch.full((heads, q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    cu = rows.cu_seqlens_q.tolist()
    for row, key_len in enumerate(rows.seqused_k.tolist()):
        blocks = block_table[row, : -(-key_len // block_size)].long()
        k = key_cache[blocks].flatten(0, 1)[:key_len].float().repeat_interleave(
            heads // kv_heads, 1)
        v = value_cache[blocks].flatten(0, 1)[:key_len].float().repeat_interleave(
            heads // kv_heads, 1)
        qs = q[cu[row]: cu[row + 1]].float()
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        if causal:
            shown = torch.arange(key_len)[None, :] <= torch.arange(
                key_len - qs.shape[0], key_len)[:, None]
            scores = scores.masked_fill(~shown.to(q.device), float("-inf"))
        lse[:, cu[row]: cu[row + 1]] = scores.logsumexp(-1)
        result[cu[row]: cu[row + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    if out is not None:
        out.copy_(result)
        return out, lse
    return result.to(q.dtype), lse
