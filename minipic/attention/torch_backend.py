"""Worker side: the position-free attention backend in plain torch (CPU platform).

K sits in the paged cache rotated in its frame (span_layout.SpanLayout.frame_offset:
a span's keys relative to the span's start, every other key at its logical
position), so a plain prompt's cache is stock vLLM's and is attended to as it is.
With spans or links each request's keys are gathered and turned forward by their
frame offsets in fp32 (key j then stands at j, or at its logical position for a
link key), then attended to by the queries. It is the reference for the Triton
kernel and the backend vLLM's CPU platform gets when minipic is on.

The cache keeps vLLM's CPU layout `[num_blocks, num_kv_heads, block_size,
2 * head_size]` (K in the first half of the last dim, V in the second), written
and read with plain torch so the layout is exactly what minipic's offload
handlers copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.v1.attention.backend import (
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

from minipic.attention.backend_traits import PositionFreeTraits, UnsupportedAttentionError
from minipic.attention.layer_check import check_current_model
from minipic.attention.links import batch_metadata, token_turns, turn_back_tokens
from minipic.attention.rope import current_rope, head_mismatch
from minipic.attention.rotation import Rotation, turn_back
from minipic.attention.span_layout import (SpanLayout, current_layout, current_span_scale,
                                           key_frame_offsets, key_turn_backs, span_key_bias,
                                           token_shifts, visible_keys)


class MiniPICTorchBackend(PositionFreeTraits, CPUAttentionBackend):
    forward_includes_kv_cache_update: bool = False
    supported_kv_cache_dtypes = ["auto"]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any head size: nothing here is specialised

    @staticmethod
    def get_impl_cls() -> type["MiniPICTorchImpl"]:
        return MiniPICTorchImpl

    @staticmethod
    def get_builder_cls() -> type["MiniPICTorchMetadataBuilder"]:
        return MiniPICTorchMetadataBuilder


@dataclass
class MiniPICTorchMetadata:
    num_actual_tokens: int
    query_start_loc: list[int]  # host lists: the torch loop indexes per request
    seq_lens: list[int]
    block_table: torch.Tensor  # [num_reqs, max_blocks]
    block_size: int
    layout: SpanLayout | None = None  # spans and links; None: plain causal attention
    token_shift: Rotation | None = None  # link tokens' Q turned back; None: all 0
    key_turn: Rotation | None = None  # K turned back before the cache write; None: all 0
    # Per request, [queries, keys] visibility (span_layout.visible_keys), built once per
    # batch for all layers; None: plain causal attention.
    visible: list[torch.Tensor] | None = None
    # Per request, [queries, keys] log(span_scale) where a query outside spans meets a
    # span key (span_layout.span_key_bias); None: span_scale 1, nothing added.
    span_bias: list[torch.Tensor] | None = None
    # Per request, (links_end, link_tokens) from the layout, and its keys' frame offsets
    # [seq_len], read once per batch (not per layer); None without a layout.
    links: list[tuple[int, int]] | None = field(init=False, default=None)
    key_frames: list[torch.Tensor] | None = field(init=False, default=None)
    # Rotations turning stored keys forward by their frames, looked up once per batch:
    # per request, or per padded group of short requests (keyed by the requests).
    key_rotations: dict[tuple[int, ...], Rotation] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if self.layout is not None:
            # With mask_markers every query stands at its logical position already.
            self.links = None if self.layout.logical is not None else list(zip(
                self.layout.links_end.tolist(), self.layout.link_tokens.tolist()))
            self.key_frames = [key_frame_offsets(self.layout, i, n, self.block_size)
                               for i, n in enumerate(self.seq_lens)]

    def key_rotation(self, requests: tuple[int, ...], longest: int, rope,
                     cos_sin: torch.Tensor) -> Rotation:
        """The rotation of `requests`' stored keys, padded to `longest` keys each and
        flattened; built at the first layer, reused by the others."""
        if requests not in self.key_rotations:
            frames = torch.zeros(len(requests), longest, dtype=torch.int32, device=cos_sin.device)
            for n, i in enumerate(requests):
                frames[n, : self.seq_lens[i]] = self.key_frames[i]
            self.key_rotations[requests] = Rotation.at(
                frames.flatten(), cos_sin, rope.rotary_dim, rope.is_neox_style, pure=True)
        return self.key_rotations[requests]


class MiniPICTorchMetadataBuilder(AttentionMetadataBuilder[MiniPICTorchMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> MiniPICTorchMetadata:
        m = common_attn_metadata
        query_start_loc = m.query_start_loc.tolist()
        seq_lens = m.seq_lens[: m.num_reqs].tolist()
        block_size = self.kv_cache_spec.block_size
        layout = current_layout(m.num_reqs, block_size, m.max_seq_len)
        scale = current_span_scale()
        if layout is not None and layout.is_plain() and not _weighs_spans(layout, scale):
            layout = None
        visible = None if layout is None else [
            visible_keys(layout, i, seq_len, query_start_loc[i + 1] - query_start_loc[i],
                         block_size) for i, seq_len in enumerate(seq_lens)]
        span_bias = None if layout is None or scale == 1.0 else [
            span_key_bias(layout, i, seq_len, query_start_loc[i + 1] - query_start_loc[i],
                          block_size, scale) for i, seq_len in enumerate(seq_lens)]
        return MiniPICTorchMetadata(
            num_actual_tokens=m.num_actual_tokens,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=m.block_table_tensor,
            block_size=block_size,
            layout=layout,
            token_shift=None if layout is None else token_turns(token_shifts(
                layout, query_start_loc, seq_lens, block_size), self.device),
            key_turn=None if layout is None else token_turns(key_turn_backs(
                layout, query_start_loc, seq_lens, block_size), self.device),
            visible=visible,
            span_bias=span_bias,
        )


def _weighs_spans(layout: SpanLayout, scale: float) -> bool:
    """span_scale applies to the batch: a plain layout ([SSep doc][PDep task], one span at
    the prompt's start) still has queries outside its span that weigh its keys, so it
    must not take the plain path, or its answer would depend on its batch-mates."""
    return scale != 1.0 and bool((layout.span_of >= 0).any())


# Requests with at most this many query tokens (decode steps, short prompts after a
# cache hit) are attended to together: one launch per layer instead of one per request.
SHORT_QUERY = 32


class MiniPICTorchImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None,
                 kv_cache_dtype: str, logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None, **unused) -> None:
        _refuse_unsupported(alibi_slopes, sliding_window, kv_cache_dtype, attn_type,
                            kv_sharing_target_layer_name, sinks)
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.logits_soft_cap = logits_soft_cap or 0.0
        self.kv_sharing_target_layer_name = None

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        md = batch_metadata(layer)
        key = turn_back_tokens(key, None if md is None else md.key_turn)
        valid = slot_mapping >= 0  # tokens whose KV is not kept have slot -1, anywhere
        slots = slot_mapping[valid].long()
        block_size = kv_cache.shape[2]
        blocks, offsets = slots // block_size, slots % block_size
        n = slot_mapping.shape[0]  # key/value may carry padding rows past the slots
        kv_cache[blocks, :, offsets, : self.head_size] = key[:n][valid].to(kv_cache.dtype)
        kv_cache[blocks, :, offsets, self.head_size :] = value[:n][valid].to(kv_cache.dtype)

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """The model is built and its rotary embedding registered: refuse a model whose
        RoPE cannot move into attention now, at load time, not on its first request."""
        check_current_model()
        problem = head_mismatch(current_rope(), self.head_size)  # raises without a RoPE
        if problem:
            raise UnsupportedAttentionError(problem)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: MiniPICTorchMetadata | None,
                output: torch.Tensor, output_scale=None, output_block_scale=None,
                **unused) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("minipic's torch backend has no fused output quantization")
        if attn_metadata is None:  # profiling run
            return output
        md = attn_metadata
        out = output.view(-1, self.num_heads, self.head_size)
        q_all = turn_back_tokens(query, md.token_shift).view(-1, self.num_heads, self.head_size)
        rope = current_rope()
        cos_sin = rope.cos_sin(query.device)
        qsl = md.query_start_loc
        short = [i for i in range(len(md.seq_lens)) if qsl[i + 1] - qsl[i] <= SHORT_QUERY]
        if len(short) > 1:  # decode steps, short prompts after a hit: one batched computation
            rows = torch.cat([torch.arange(qsl[i], qsl[i + 1]) for i in short]).to(query.device)
            out[rows] = self._short_queries(q_all, kv_cache, md, short, rope,
                                            cos_sin).to(out.dtype)
        batched = set(short) if len(short) > 1 else set()
        for i, seq_len in enumerate(md.seq_lens):
            if i in batched:
                continue
            q = q_all[qsl[i] : qsl[i + 1]]
            k, v = gather_request_kv(kv_cache, md.block_table[i], seq_len, self.head_size)
            if md.key_frames is not None:
                k = md.key_rotation((i,), seq_len, rope, cos_sin).apply(k)
            visible = None if md.visible is None else md.visible[i]
            bias = None if md.span_bias is None else md.span_bias[i]
            near = links_take_no_room(q, md.links, i, seq_len, rope, cos_sin)
            out[qsl[i] : qsl[i + 1]] = causal_attention(
                q, k, v, self.scale, self.logits_soft_cap, visible, near, bias).to(out.dtype)
        return output

    def _short_queries(self, q_all: torch.Tensor, kv_cache: torch.Tensor,
                       md: MiniPICTorchMetadata, requests: list[int], rope,
                       cos_sin: torch.Tensor) -> torch.Tensor:
        """Attention of requests with few query tokens each, padded to the longest request
        and query; returns their query rows in batch order."""
        qsl, device = md.query_start_loc, q_all.device
        lengths = [qsl[i + 1] - qsl[i] for i in requests]
        seq_lens = [md.seq_lens[i] for i in requests]
        longest, most = max(seq_lens), max(lengths)
        blocks = -(-longest // md.block_size)
        pages = kv_cache[md.block_table[requests, :blocks].long()]  # [N, nb, H, B, 2D]
        kv = pages.permute(0, 1, 3, 2, 4).reshape(len(requests), blocks * md.block_size,
                                                  kv_cache.shape[1], -1)[:, :longest]
        k = kv[..., : self.head_size]
        if md.key_frames is not None:
            rotation = md.key_rotation(tuple(requests), longest, rope, cos_sin)
            k = rotation.apply(k.reshape(-1, *k.shape[2:])).view(k.shape)
        # Slots past a request's length hold whatever the page held (never written, or
        # another request's): zero weight times NaN would still be NaN, so zero them.
        kept = torch.arange(longest, device=device)[None, :] < torch.tensor(seq_lens,
                                                                             device=device)[:, None]
        v = torch.where(kept[..., None, None], kv[..., self.head_size:], 0)
        q = q_all.new_zeros(len(requests), most, *q_all.shape[1:])
        visible = torch.zeros(len(requests), most, longest, dtype=torch.bool, device=device)
        bias = None if md.span_bias is None else torch.zeros(visible.shape, device=device)
        for n, (i, t, s) in enumerate(zip(requests, lengths, seq_lens)):
            q[n, :t] = q_all[qsl[i] : qsl[i] + t]
            visible[n, :t, :s] = causal_rows(t, s, device) if md.visible is None else md.visible[i]
            visible[n, t:, 0] = True  # padding rows: any one key, their output is dropped
            if bias is not None:
                bias[n, :t, :s] = md.span_bias[i]
        out = attend(q, k, v, self.scale, self.logits_soft_cap, visible,
                     self._turned_back(q, md, requests, lengths, seq_lens, rope, cos_sin), bias)
        return torch.cat([out[n, :t] for n, t in enumerate(lengths)])

    @staticmethod
    def _turned_back(q: torch.Tensor, md: MiniPICTorchMetadata, requests: list[int],
                     lengths: list[int], seq_lens: list[int], rope, cos_sin: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """attend's `alternative` for the padded batch q [N, T, Hq, D]: each request's
        queries past its links turned back, and the keys before its links; None when no
        request has a query past its links."""
        found = [links_take_no_room(q[n, :t], md.links, i, s, rope, cos_sin)
                 for n, (i, t, s) in enumerate(zip(requests, lengths, seq_lens))]
        if all(f is None for f in found):
            return None
        q_near = q.float().clone()
        keys = torch.zeros(q.shape[0], max(seq_lens), dtype=torch.bool, device=q.device)
        for n, (t, f) in enumerate(zip(lengths, found)):
            if f is not None:
                q_near[n, :t], keys[n, : f[1]] = f[0], True
        return q_near, keys


def gather_request_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int,
                      head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The request's first `seq_len` keys and values, each [seq_len, kv_heads, head_size]."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    blocks = kv_cache[block_ids[:num_blocks].long()]  # [nb, H, B, 2D]
    kv = blocks.permute(0, 2, 1, 3).reshape(num_blocks * block_size, kv_cache.shape[1], -1)
    kv = kv[:seq_len]
    return kv[..., :head_size], kv[..., head_size:]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     soft_cap: float = 0.0, visible: torch.Tensor | None = None,
                     near: tuple[torch.Tensor, int] | None = None,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the last len(q) positions over all len(k) keys, fp32.

    q [T, Hq, D] (rotated), k [S, Hkv, D] (rotated), v [S, Hkv, D]; query t sits
    at position S - T + t and sees keys 0..S-T+t (cached prefix plus causal), or
    the keys `visible` [T, S] allows (span_layout.visible_keys). `near` (q_near, n):
    the keys before n are scored with q_near (links_take_no_room). `bias` [T, S]: added
    to the scores (span_key_bias).
    """
    if visible is None:
        visible = causal_rows(q.shape[0], k.shape[0], q.device)
    alternative = None
    if near is not None:
        keys = torch.arange(k.shape[0], device=q.device)[None, :] < near[1]
        alternative = (near[0][None], keys)
    return attend(q[None], k[None], v[None], scale, soft_cap, visible[None], alternative,
                  None if bias is None else bias[None])[0]


def links_take_no_room(q: torch.Tensor, links: list[tuple[int, int]] | None, row: int,
                       seq_len: int, rope, cos_sin: torch.Tensor
                       ) -> tuple[torch.Tensor, int] | None:
    """(q_near, links_end) for request `row`'s queries q [T, Hq, D] (the last T of
    seq_len), None when it has no links (`links`: MiniPICTorchMetadata.links). Queries at or past links_end stand link_tokens
    positions earlier (SpanLayout): against the keys before links_end they score
    rotated back by link_tokens; the other queries score as they are. None as well
    when no query is past the links (links and spans computing)."""
    if links is None or links[row][1] == 0:
        return None
    end, room = links[row]
    after = torch.arange(seq_len - q.shape[0], seq_len, device=q.device) >= end
    if not bool(after.any()):
        return None
    back = turn_back(q, torch.full((q.shape[0],), room, device=q.device), cos_sin,
                     rope.rotary_dim, rope.is_neox_style)
    return torch.where(after[:, None, None], back, q.float()), end


def causal_rows(num_queries: int, num_keys: int, device) -> torch.Tensor:
    """[T, S] bool: the last T of S positions, each seeing the keys up to itself."""
    q_pos = torch.arange(num_keys - num_queries, num_keys, device=device)[:, None]
    return torch.arange(num_keys, device=device)[None, :] <= q_pos


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, soft_cap: float,
           visible: torch.Tensor,
           alternative: tuple[torch.Tensor, torch.Tensor] | None = None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """Batched masked attention in fp32: q [N, T, Hq, D], k and v [N, S, Hkv, D],
    visible [N, T, S] -> [N, T, Hq, D]. `alternative` (q_alt like q, keys [N, S] bool):
    those keys are scored with q_alt instead of q. `bias` [N, T, S]: added to the scores
    (after the soft cap, as a weight on the key)."""
    n, t, num_heads, d = q.shape
    kv_heads = k.shape[2]  # GQA/MQA: query heads come in groups, one per kv head

    def score(queries: torch.Tensor) -> torch.Tensor:
        grouped = queries.float().view(n, t, kv_heads, num_heads // kv_heads, d)
        return torch.einsum("ntkgd,nskd->nkgts", grouped, k.float()) * scale

    scores = score(q)
    if alternative is not None:
        q_alt, keys = alternative
        scores = torch.where(keys[:, None, None, None, :], score(q_alt), scores)
    if soft_cap > 0:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    if bias is not None:
        scores = scores + bias[:, None, None]
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    out = torch.einsum("nkgts,nskd->ntkgd", scores.softmax(dim=-1), v.float())
    return out.reshape(n, t, num_heads, d)


def _refuse_unsupported(alibi_slopes, sliding_window, kv_cache_dtype, attn_type,
                        kv_sharing_target_layer_name, sinks) -> None:
    problems = {
        "ALiBi slopes": alibi_slopes is not None,
        "sliding-window attention": sliding_window not in (None, -1),
        f"kv_cache_dtype={kv_cache_dtype!r} (only 'auto')": kv_cache_dtype != "auto",
        f"attention type {attn_type!r} (only decoder self-attention)": attn_type != AttentionType.DECODER,
        "cross-layer KV sharing": kv_sharing_target_layer_name is not None,
        "attention sinks": sinks is not None,
    }
    found = [name for name, present in problems.items() if present]
    if found:
        raise UnsupportedAttentionError(
            "minipic's position-free attention does not support " + ", ".join(found))
