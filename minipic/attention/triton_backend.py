"""Worker side: minipic's position-free attention backend for CUDA (Triton).

It is vLLM's Triton backend with these changes: attention rotates K per tile
by the keys' logical positions (`triton_kernel.unified_attention_rope`), because
minipic's Q-only RoPE leaves K unrotated in the cache; batches with span markers
pass the kernel their SpanLayout tables (span_layout.py: span segments and EPIC
link blocks), and link tokens' Q and K are turned back by their shift first
(attention.links), in forward and in the KV cache write. Everything else is
inherited, so it follows the installed vLLM: the KV cache shape and layout,
the KV cache write (which stores whatever K it is given, here unrotated), and
the metadata builder with its static split-KV buffers (CUDA-graph safe).

CUDA graphs: the span tables are static buffers and a captured launch always
reads them, so captured decode steps keep spans and hidden span heads right.
The link turn-back is host-driven and is not part of a captured graph: a full
graph replay (uniform decode batches) would leave a link token's Q and K
unturned. Decode tokens are generated after the prompt, so they sit in a link
segment only if a prompt ends inside one (EPIC prompts end with their PDep task).

Registered as `AttentionBackendEnum.CUSTOM`; minipic's attention-selector
patch returns it whenever minipic is on, so users never pick it by hand.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)

from minipic.attention.backend_traits import PositionFreeTraits, UnsupportedAttentionError
from minipic.attention.layer_check import check_current_model
from minipic.attention.rope import current_rope, head_mismatch
from minipic.attention.links import batch_metadata, turn_back_links
from minipic.attention.span_layout import SpanLayout, current_layout, token_shifts
from minipic.attention.triton_kernel import (
    SPLIT_KV_MAX_TOKENS,
    angle_addition_holds,
    check_rope,
    span_table_args,
    unified_attention_rope,
)

# Quantised caches would need dequantisation before the rotation: not implemented.
_SUPPORTED_KV_CACHE_DTYPES = ("auto", "float16", "bfloat16")


class MiniPICTritonBackend(PositionFreeTraits, TritonAttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(_SUPPORTED_KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # the registry slot minipic registers this class under

    @staticmethod
    def get_impl_cls() -> type["MiniPICTritonImpl"]:
        return MiniPICTritonImpl

    @staticmethod
    def get_builder_cls() -> type["MiniPICTritonMetadataBuilder"]:
        return MiniPICTritonMetadataBuilder

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return False  # the launch shape depends on the batch's longest query


class MiniPICTritonMetadataBuilder(TritonAttentionMetadataBuilder):
    # Full CUDA graphs only for single-token decode batches: a replayed graph skips the
    # host's link turn-back (attention.links), and links are prompt tokens.
    _cudagraph_support: ClassVar[AttentionCGSupport] = \
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    """vLLM's Triton metadata plus minipic's span tables and link shifts (span_layout.py).

    Sets on the metadata: `minipic_tables` (a SpanLayout of static buffers, rows of
    this batch rewritten each build), `minipic_has_spans` (the batch has
    markers: the kernel applies the tables), `minipic_token_shift` (per token link
    shifts, None without links) and `minipic_span_block_size`."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._enlarge_split_kv_buffers()
        max_blocks = -(-vllm_config.model_config.max_model_len // self.block_size)
        # Static: CUDA graphs capture their addresses; each build rewrites its rows.
        # They start as plain causal attention (no span, context position = index).
        self.tables = _plain_layout(vllm_config.scheduler_config.max_num_seqs, max_blocks,
                                    self.block_size, device)

    def _enlarge_split_kv_buffers(self) -> None:
        """vLLM sizes them for decode batches (seq_threshold_3D tokens); minipic's kernel
        also splits short queries over long contexts (triton_kernel._split_short_queries),
        up to SPLIT_KV_MAX_TOKENS tokens. Allocated once: CUDA graphs keep the addresses."""
        for name in ("softmax_segm_output", "softmax_segm_max", "softmax_segm_expsum"):
            buffer = getattr(self, name)
            if buffer.shape[0] < SPLIT_KV_MAX_TOKENS:
                setattr(self, name, buffer.new_empty((SPLIT_KV_MAX_TOKENS, *buffer.shape[1:])))

    def build(self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False):
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        m = common_attn_metadata
        layout = None if _capturing() else current_layout(m.num_reqs, self.block_size)
        if layout is not None and getattr(layout, "quiet", None) is not None:
            raise UnsupportedAttentionError(
                "mask_markers is not implemented in minipic's Triton attention")
        if layout is not None:
            # Plain batches too: a full CUDA graph captured with the tables reads them.
            self._fill_tables(layout)
        has_spans = layout is not None and not layout.is_plain()
        metadata.minipic_tables = self.tables
        metadata.minipic_has_spans = has_spans
        metadata.minipic_token_shift = _link_shifts(m, layout, self.block_size) if has_spans \
            else None
        metadata.minipic_span_block_size = self.block_size
        return metadata

    def _fill_tables(self, layout: SpanLayout) -> None:
        static = self.tables
        reqs = layout.span_of.shape[0]
        blocks = min(layout.span_of.shape[1], static.span_of.shape[1])  # past max_model_len: unread
        static.span_of[:reqs, :blocks].copy_(layout.span_of[:, :blocks], non_blocking=True)
        static.context_pos[:reqs, :blocks].copy_(layout.context_pos[:, :blocks], non_blocking=True)
        static.links_end[:reqs].copy_(layout.links_end, non_blocking=True)
        static.link_tokens[:reqs].copy_(layout.link_tokens, non_blocking=True)


class MiniPICTritonImpl(TritonAttentionImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _refuse_unsupported(self)
        # The layer must not hand us fp8 queries or expect fused output quantisation.
        self.supports_quant_query_input = False
        self._cos_sin: torch.Tensor | None = None
        self._angle_addition_ok = False

    def fused_output_quant_supported(self, quant_key) -> bool:
        return False

    def fused_rope_kvcache_supported(self) -> bool:
        return False  # a RoPE+cache fusion would store rotated K

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        # Model built: its rotary embedding is registered. Move the table now,
        # before any CUDA graph capture, and fail at load time, not mid-serving.
        super().process_weights_after_loading(act_dtype)
        check_current_model()
        if torch.cuda.is_available():
            self._rope_table(torch.device("cuda", torch.cuda.current_device()))

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise UnsupportedAttentionError("minipic's attention has no fused output quantization")
        if attn_metadata is None:
            return output.fill_(0)  # profiling run
        # Runs eagerly between graph pieces: host work is attribute reads and views only.
        md = attn_metadata
        if md.causal is not True or getattr(md, "mm_prefix_range_tensor", None) is not None:
            raise UnsupportedAttentionError(
                "minipic's attention is causal decoder attention only (no per-request "
                "causality, no multimodal bidirectional ranges)")
        n = md.num_actual_tokens
        key_cache, value_cache = split_kv_cache(kv_cache, self.head_size)
        rope = current_rope()
        query = turn_back_links(query, _token_shift(md))
        unified_attention_rope(
            query[:n], key_cache, value_cache, output[:n],
            cu_seqlens_q=md.query_start_loc, seqused_k=md.seq_lens,
            max_seqlen_q=md.max_query_len, block_table=md.block_table,
            softmax_scale=self.scale, cos_sin=self._rope_table(query.device),
            rotary_dim=rope.rotary_dim, is_neox_style=rope.is_neox_style,
            segm_output=md.softmax_segm_output, segm_max=md.softmax_segm_max,
            segm_expsum=md.softmax_segm_expsum, seq_threshold_3d=md.seq_threshold_3D,
            allow_angle_addition=self._angle_addition_ok,
            **_span_tables(md),
        )
        return output

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """vLLM's cache write, with link tokens' K turned back first (attention.links)."""
        md = batch_metadata(layer)
        key = turn_back_links(key, _token_shift(md))
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def _rope_table(self, device: torch.device) -> torch.Tensor:
        """The model's fp32 cos/sin table on `device`, checked and moved once."""
        if self._cos_sin is None or self._cos_sin.device != device:
            rope = current_rope()
            problem = head_mismatch(rope, self.head_size)
            if problem:
                raise UnsupportedAttentionError(problem)
            table = rope.cos_sin(device)
            check_rope(self.head_size, rope.rotary_dim, table)
            self._angle_addition_ok = _angle_addition_holds_cached(rope, table)
            self._cos_sin = table
        return self._cos_sin


def _plain_layout(reqs: int, blocks: int, block_size: int, device) -> SpanLayout:
    """Tables that say "no spans, no links": stock causal attention. `shift` stays zero
    and is never rewritten: the kernel reads none (link turn-back is host work)."""
    span_of = torch.full((reqs, blocks), -1, dtype=torch.int32, device=device)
    context_pos = (torch.arange(blocks, dtype=torch.int32, device=device) * block_size
                   ).expand(reqs, -1).contiguous()
    return SpanLayout(span_of, context_pos, torch.zeros_like(span_of))


def _link_shifts(m, layout: SpanLayout, block_size: int) -> torch.Tensor | None:
    """Per token of the batch, its link shift on the device; None without links (host
    lists from the metadata's CPU copies: this runs for batches with links only)."""
    if not layout.has_links():
        return None
    query_start_loc = m.query_start_loc_cpu[: m.num_reqs + 1].tolist()
    seq_lens_cpu = getattr(m, "seq_lens_cpu", None)  # a property on vLLM 0.25
    seq_lens = (m.seq_lens if seq_lens_cpu is None else seq_lens_cpu)[: m.num_reqs].tolist()
    shifts = token_shifts(layout, query_start_loc, seq_lens, block_size)
    return shifts.to(m.query_start_loc.device, non_blocking=True)


def _angle_addition_holds_cached(rope, table: torch.Tensor) -> bool:
    """Once per model (layers share its rope). Reads the table back: load time, never
    in a forward. Kept on the rope's parameters, which live exactly as long as the model."""
    if getattr(rope, "angle_addition_ok", None) is None:
        rope.angle_addition_ok = angle_addition_holds(table)
    return rope.angle_addition_ok


def _span_tables(md) -> dict:
    """The kernel's span-table arguments: none for a batch without markers (the
    stock-shaped launch), except under CUDA graph capture, whose launch is replayed
    for later batches that may have markers (the tables then hold each batch's rows)."""
    if getattr(md, "minipic_tables", None) is None:
        return {}  # metadata not built by MiniPICTritonMetadataBuilder (unit tests)
    if not md.minipic_has_spans and not _capturing():
        return {}
    return span_table_args(md.minipic_tables, md.minipic_span_block_size)


def _token_shift(md) -> torch.Tensor | None:
    """The batch's link shifts. None under CUDA graph capture: the turn-back would be
    captured with this (dummy) batch's shifts and replayed on every later batch."""
    shift = getattr(md, "minipic_token_shift", None)
    return None if shift is None or _capturing() else shift


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def split_kv_cache(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views [blocks, block_size, kv_heads, head_size] of the layer's cache.

    vLLM 0.25 keeps [blocks, 2, block_size, kv_heads, head_size]; later releases
    [blocks, kv_heads, block_size, 2 * head_size]. Views only: no copies.
    """
    if kv_cache.dim() == 5:
        return kv_cache.unbind(1)
    return kv_cache.transpose(1, 2).split(head_size, dim=-1)


def _refuse_unsupported(impl: MiniPICTritonImpl) -> None:
    problems = {
        f"kv_cache_dtype={impl.kv_cache_dtype!r} (fp8/int8/int4 caches are not supported: "
        f"use one of {', '.join(_SUPPORTED_KV_CACHE_DTYPES)})":
            impl.kv_cache_dtype not in _SUPPORTED_KV_CACHE_DTYPES,
        "ALiBi slopes": impl.alibi_slopes is not None,
        "sliding-window attention": tuple(impl.sliding_window) != (-1, -1),
        "chunked local attention": getattr(impl, "chunk_lookback", -1) != -1,
        "logits soft-capping": bool(impl.logits_soft_cap),
        "attention sinks": impl.sinks is not None,
        f"attention type {impl.attn_type!r} (only decoder self-attention)":
            impl.attn_type != AttentionType.DECODER,
    }
    found = [name for name, present in problems.items() if present]
    if found:
        raise UnsupportedAttentionError(
            "minipic's position-free Triton attention does not support " + "; ".join(found))
