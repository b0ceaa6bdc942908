"""Worker side: minipic's attention backends for CUDA, on vLLM's own backends.

Keys are stored in their frames (span_layout.SpanLayout.frame_offset), so a batch
whose layout is plain (no span markers, or only a span at the prompt's start) is stock
vLLM's: its KV cache write and its attention are the stock backend's own, nothing
added (eager; compiled, see below). Any other batch turns its new keys
back into their frames before the cache write (attention.links; on the rows path in the
launch that turns the queries, the write left to forward), then attends the same paged
cache in one of two ways:
  * on FlashAttention (the default): one causal and one non-causal varlen call, each
    query turned back into the frame of the keys a row reads, merged by log-sum-exp
    (segment_plan.py, segment_attention.py);
  * minipic's Triton kernel (`triton_kernel.unified_attention_rope`), which turns keys
    forward by their frame offsets per tile and applies the span and EPIC link rules:
    for short span prefills run eagerly under span_attention="auto" (a span hit's
    question: one launch a layer, no plan; `_short_prefill`), for batches with
    mask_markers (it hides single marker and padding keys), on FA2 and for fp32 models,
    and with span_attention="triton".
Two stock bases, the same additions (`SpanBatchBuilder`, `SpanBatchImpl`):
  * FlashAttention (FA3 on Hopper, FA2 from compute capability 8.0), for fp16/bf16
    models: what stock vLLM picks there;
  * vLLM's Triton backend otherwise (fp32 models, older GPUs).
vLLM 0.25's FlashAttention and Triton backends share the cache layout
`[blocks, 2, block_size, kv_heads, head_size]` (later releases
`[blocks, kv_heads, block_size, 2 * head_size]`: `split_kv_cache` reads both).

CUDA graphs: a batch's path (stock attention, the rows or the span kernel) is chosen
per batch in eager code between piecewise graph pieces. On FlashAttention rows (FA3,
Model Runner V2, no mask_markers) two kinds of step also replay full graphs, on the rows
path from buffers of a fixed capacity (graph_rows.py): uniform decode steps over span
prompts (`AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE`), and, with the option
`prefill_graphs`, one request's short prefill over spans, a span hit's question
(minipic's prefill graphs, captured beside vLLM's); a step without
spans, or past the capacity, is sent to the piecewise graphs (graph_dispatch.py).
Elsewhere `AttentionCGSupport.NEVER`: piecewise graphs, attention run eagerly between them.

Registered as `AttentionBackendEnum.CUSTOM`; minipic's attention-selector patch
returns one of them whenever minipic is on, so users never pick it by hand.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np
import torch
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)

from minipic.attention.backend_traits import PositionFreeTraits, UnsupportedAttentionError
from minipic.attention.graph_dispatch import (graph_step, note_block_size, prefill_graph_sizes,
                                              prefill_plan)
from minipic.attention.graph_rows import GraphRows, GraphShape
from minipic.attention.layer_check import check_current_model
from minipic.attention.links import batch_metadata, token_turns, turn_back_tokens
from minipic.attention.rope import current_rope, head_mismatch
from minipic.attention.plan_groups import copy_limit, earlier_copies, group_plans, token_groups
from minipic.attention.segment_attention import (GroupedBatch, NewKeys, grouped_attention,
                                                 prepare, prepare_groups, segment_attention,
                                                 vllm_flash_rows, with_block_table)
from minipic.attention.segment_kernels import compile_variants
from minipic.attention.segment_plan import segment_plan
from minipic.attention.span_layout import current_layout, key_turn_backs, token_shifts
from minipic.attention.triton_kernel import (
    MIN_GRID_2D,
    SPLIT_KV_MAX_TOKENS,
    check_rope,
    compile_short_prefills,
    quiet_words,
    split_kv_buffers,
    span_table_args,
    unified_attention_rope,
)

# Quantised caches would need dequantisation before the rotation: not implemented.
_SUPPORTED_KV_CACHE_DTYPES = ("auto", "float16", "bfloat16")


class SpanBatchBuilder:
    """Mixed in before a vLLM metadata builder: its metadata plus, for batches with
    markers, what the span kernel needs (span_layout.py).

    Sets on the metadata: `minipic_rows` (segment_attention.SegmentBatch, made ready on
    the device) for span batches attended by FlashAttention rows, else None;
    `minipic_tables` (the per block tables of this batch's SpanLayout, on the device)
    for span batches attended by the kernel, else None;
    `minipic_quiet_bits` (mask_markers: triton_kernel.quiet_words, else None),
    `minipic_token_shift` (kernel path: the Q turn-backs of link tokens, a rotation.Rotation;
    the rows fold them into their own turns; None
    without links), `minipic_key_turn` (the K turn-backs before the cache write, None
    when all are 0), `minipic_span_block_size`, and the kernel's split-KV scratch
    (`minipic_split_kv_scratch`, `minipic_seq_threshold_3d`) and its launches, bound once
    for every layer (`minipic_launches`, segment_kernels.RepeatedLaunch), on arguments made
    at the first layer (`minipic_kernel_args`, SpanBatchImpl._kernel_args)."""

    # Whether the base backend can attend span batches as FlashAttention rows.
    has_flash_rows: ClassVar[bool] = False
    full_graphs = False  # full graphs of the rows: decode steps, questions (set in __init__)
    short_prefills_on_kernel = False  # span_attention "auto" (set in __init__)
    graph_tokens = 0  # the largest prefill batch that replays piecewise graphs (__init__)
    graph_rows: GraphRows | None = None  # made at the first graph step
    graph_max_prefill = 0  # the largest prefill graph's tokens (set in __init__)
    _capturing = False  # build() runs for a full graph's capture

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        if cls.has_flash_rows and _full_decode_graphs(vllm_config, kv_cache_spec.head_size):
            return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        return AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # vLLM's Triton rule: a decode batch of fewer requests than this splits its KV.
        self.seq_threshold_3d = MIN_GRID_2D // self.num_heads_kv
        self.split_kv_scratch = split_kv_buffers(
            max(SPLIT_KV_MAX_TOKENS, self.seq_threshold_3d), self.num_heads_q, self.headdim,
            device)
        from minipic.config import mask_markers, prefill_graphs, span_attention

        # FA3 only: FA2's varlen LSE for GQA decodes (its swapped query groups) is untested
        attention = span_attention(vllm_config)
        self.use_flash_rows = (self.has_flash_rows and attention != "triton"
                               and _flash_attention_version(kv_cache_spec.head_size) == 3)
        self.short_prefills_on_kernel = attention == "auto"
        self.graph_tokens = graph_prefill_tokens(vllm_config)
        self.full_graphs = (self.use_flash_rows
                            and _full_decode_graphs(vllm_config, kv_cache_spec.head_size))
        if self.use_flash_rows and not mask_markers(vllm_config):  # else the span kernel's
            rope = current_rope()
            compile_variants(self.num_heads_q, self.num_heads_kv, self.headdim,
                             vllm_config.model_config.dtype, rope.rotary_dim,
                             rope.is_neox_style, torch.device(device),
                             vllm_config.scheduler_config.max_num_batched_tokens)
            if self.short_prefills_on_kernel:
                compile_short_prefills(self.num_heads_q, self.num_heads_kv, self.headdim,
                                       vllm_config.model_config.dtype, rope.rotary_dim,
                                       rope.is_neox_style, self.block_size,
                                       torch.device(device))
        # Past this many query copies a span batch goes in groups of query tokens
        # (plan_groups.py): 500 short tasks over ten documents each, or one 4k-token task
        # chunk over 40 documents, copy 160k.
        self.row_copy_limit = copy_limit(
            vllm_config.scheduler_config.max_num_batched_tokens,
            getattr(vllm_config.model_config.hf_text_config, "intermediate_size", None),
            vllm_config.parallel_config.tensor_parallel_size, self.num_heads_q, self.headdim,
            vllm_config.model_config.dtype.itemsize)
        if self.full_graphs:
            note_block_size(self.block_size)
            self.graph_max_reqs = min(vllm_config.scheduler_config.max_num_seqs,
                                      vllm_config.compilation_config.max_cudagraph_capture_size
                                      or vllm_config.scheduler_config.max_num_seqs)
            self.graph_max_seqlen_k = vllm_config.model_config.max_model_len
            if prefill_graphs(vllm_config):  # whatever the mode vLLM resolves later
                self.graph_max_prefill = max(prefill_graph_sizes(
                    vllm_config.compilation_config.cudagraph_capture_sizes), default=0)

    def build_for_cudagraph_capture(self, common_attn_metadata):
        """A full graph's capture: its rows at capacity, every one padding."""
        self._capturing = True
        try:
            return super().build_for_cudagraph_capture(common_attn_metadata)
        finally:
            self._capturing = False

    def build(self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False):
        from vllm.utils.torch_utils import set_default_torch_num_threads

        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        # The span layout and plan are many small host tensor ops: one thread runs them.
        # Torch's pool woke for each and busy-waited beside the thread that runs the step:
        # an eager decode's engine core used 1.73 CPU seconds a second (stock 0.86), in one
        # thread 0.84-0.87 (docs/benchmarks.md, decode steps).
        with set_default_torch_num_threads(1):
            return self._add_spans(metadata, common_attn_metadata)

    def _add_spans(self, metadata, m):
        """build()'s metadata with minipic's fields (see the class)."""
        real_reqs = 0 if self._capturing else graph_step()
        if self.full_graphs and real_reqs is not None:
            return self._graph_build(metadata, m, real_reqs)
        decoding = np.diff(m.query_start_loc_cpu[: m.num_reqs + 1].numpy()) == 1
        layout = current_layout(m.num_reqs, self.block_size, m.max_seq_len, decoding)
        has_spans = layout is not None and not layout.is_plain()
        metadata.minipic_tables = metadata.minipic_quiet_bits = None
        metadata.minipic_rows = None
        metadata.minipic_token_shift = metadata.minipic_key_turn = None
        if has_spans:
            query_start_loc, seq_lens = _host_extents(m)
            if (self.use_flash_rows and layout.quiet is None
                    and not (self.short_prefills_on_kernel
                             and _short_prefill(layout, query_start_loc, self.graph_tokens))):
                metadata.minipic_rows = self._rows(layout, query_start_loc, seq_lens, m)
            if metadata.minipic_rows is None:
                self._kernel_tables(metadata, layout, seq_lens)
                metadata.minipic_token_shift = token_turns(token_shifts(
                    layout, query_start_loc, seq_lens, self.block_size), self.device)
            metadata.minipic_key_turn = token_turns(key_turn_backs(
                layout, query_start_loc, seq_lens, self.block_size), self.device)
        metadata.minipic_launches = {}  # the span kernel's, bound at the first layer
        metadata.minipic_kernel_args = None  # made at the first layer
        metadata.minipic_span_block_size = self.block_size
        metadata.minipic_split_kv_scratch = self.split_kv_scratch
        metadata.minipic_seq_threshold_3d = self.seq_threshold_3d
        return metadata

    def _graph_build(self, metadata, m, real_reqs: int):
        """A step a full graph replays (or captures) on the rows path (graph_rows.py): a
        decode graph's first real_reqs requests, or a prefill graph's one request (its
        question, the graph's first tokens), the rest padding. vLLM builds it at the
        graph's sizes: a decode graph's requests are its tokens, a prefill graph has one."""
        shape = GraphShape(m.num_actual_tokens, prefill=m.num_reqs < m.num_actual_tokens)
        if real_reqs and (m.max_query_len != 1) != shape.prefill:
            raise RuntimeError("minipic: a full graph step of the wrong kind (a decode graph "
                               "runs one query per request, a prefill graph one request)")
        rope = current_rope()
        if self.graph_rows is None:
            self.graph_rows = GraphRows(
                self.graph_max_reqs, self.graph_max_prefill, m.block_table_tensor.shape[1],
                self.graph_max_seqlen_k, rope.rotary_dim, rope.is_neox_style, self.device)
        query_start_loc, seq_lens = _host_extents(m)
        query_start_loc, seq_lens = query_start_loc[: real_reqs + 1], seq_lens[:real_reqs]
        layout = current_layout(real_reqs, self.block_size, m.max_seq_len) if real_reqs else None
        plan = key_turns = None
        if layout is not None and not layout.is_plain():
            plan = prefill_plan(layout, query_start_loc, seq_lens) or segment_plan(
                layout.to("cpu"), query_start_loc, seq_lens, self.block_size, link_shifts=True)
            key_turns = key_turn_backs(layout, query_start_loc, seq_lens, self.block_size)
        elif real_reqs and shape.prefill:  # a plain batch is one query per request
            raise RuntimeError("minipic: a prefill graph step without spans (the dispatch "
                               "check sends those to the piecewise graphs)")
        metadata.minipic_rows, metadata.minipic_key_turn = self.graph_rows.fill(
            shape, plan, seq_lens, key_turns, m.block_table_tensor, self.block_size,
            rope.cos_sin(self.device))
        metadata.minipic_tables = metadata.minipic_quiet_bits = None
        metadata.minipic_token_shift = None
        metadata.minipic_span_block_size = self.block_size
        metadata.minipic_split_kv_scratch = self.split_kv_scratch
        metadata.minipic_seq_threshold_3d = self.seq_threshold_3d
        return metadata

    def _rows(self, layout, query_start_loc: list[int], seq_lens: list[int], m):
        """The batch's FlashAttention rows, planned on the host (one copy of the tables)
        and made ready on the device for every layer: in groups of query tokens when they
        would copy more queries than row_copy_limit (plan_groups.py)."""
        host_layout = layout.to("cpu")
        plan = segment_plan(host_layout, query_start_loc, seq_lens, self.block_size,
                            link_shifts=True)
        rope = current_rope()
        cos_sin = rope.cos_sin(self.device)
        if earlier_copies(plan) <= self.row_copy_limit:
            return prepare(plan, m.block_table_tensor, cos_sin, rope.rotary_dim,
                           rope.is_neox_style)
        groups = token_groups(plan, query_start_loc, self.row_copy_limit)
        return prepare_groups(
            group_plans(host_layout, query_start_loc, seq_lens, self.block_size, groups,
                        link_shifts=True),
            m.block_table_tensor, cos_sin, rope.rotary_dim, rope.is_neox_style)

    def update_block_table(self, metadata, blk_table: torch.Tensor, slot_mapping: torch.Tensor):
        """vLLM reuses one KV cache group's metadata for another with its own block table:
        the rows' physical tables follow it."""
        new = super().update_block_table(metadata, blk_table, slot_mapping)
        # its own kernel launches: a shared cache would bind again at every change of group
        new.minipic_launches = {}
        new.minipic_kernel_args = None  # its own block table
        if getattr(metadata, "minipic_rows", None) is not None:
            new.minipic_rows = with_block_table(metadata.minipic_rows, blk_table)
        return new

    def _kernel_tables(self, metadata, layout, seq_lens: list[int]) -> None:
        """Per block tables to the device for the span kernel; per token ones stay
        (mask_markers: as bits)."""
        metadata.minipic_tables = dataclasses.replace(
            layout, quiet=None, logical=None, span_id=None).to(self.device)
        if layout.quiet is not None:
            metadata.minipic_quiet_bits = quiet_words(
                layout.quiet, max(seq_lens)).to(self.device, non_blocking=True)


class SpanBatchImpl:
    """Mixed in before a vLLM attention impl: stock for batches without markers, the
    span kernel (and keys turned into their frames) for batches with them."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _refuse_unsupported(self)
        # The layer must not hand us fp8 queries or expect fused output quantisation.
        self.supports_quant_query_input = False
        self._cos_sin: torch.Tensor | None = None
        # (kv_cache, slot_mapping) of a cache write left to forward (do_kv_cache_update)
        self._deferred_write: tuple[torch.Tensor, torch.Tensor] | None = None

    def fused_output_quant_supported(self, quant_key) -> bool:
        return False

    def fused_rope_kvcache_supported(self) -> bool:
        return False  # the fused write would skip the turn into span frames

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        # Model built: its rotary embedding is registered. Move the table now and
        # fail at load time, not mid-serving.
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
        md = attn_metadata
        rows = None if md is None else getattr(md, "minipic_rows", None)
        if rows is None and (md is None or getattr(md, "minipic_tables", None) is None):
            # Profiling run, or a batch without markers: the stock backend.
            return super().forward(layer, query, key, value, kv_cache, md, output)
        if md.causal is not True or getattr(md, "mm_prefix_range_tensor", None) is not None:
            raise UnsupportedAttentionError(
                "minipic's attention is causal decoder attention only (no per-request "
                "causality, no multimodal bidirectional ranges)")
        n = md.num_actual_tokens
        key_cache, value_cache = split_kv_cache(kv_cache, self.head_size)
        if rows is not None:  # link shifts are in the rows' turns
            attend = grouped_attention if isinstance(rows, GroupedBatch) else segment_attention
            attend(query[:n], key_cache, value_cache, output[:n], rows, self.run_flash_rows,
                   self._new_keys(layer, key, value, md))
            return output
        if md.minipic_kernel_args is None:  # the first layer: each layer has the same tables
            md.minipic_kernel_args = self._kernel_args(md)
        query = turn_back_tokens(query, md.minipic_token_shift)
        unified_attention_rope(query[:n], key_cache, value_cache, output[:n],
                               softmax_scale=self.scale, cos_sin=self._rope_table(query.device),
                               **md.minipic_kernel_args)
        return output

    @staticmethod
    def _kernel_args(md) -> dict:
        """The span kernel's arguments that come from the batch, made once: the same
        objects at every layer, so its launches stay bound (segment_kernels.RepeatedLaunch),
        and no layer pays for them again. The layer's own (its scale, its rope table) are
        passed by each layer."""
        rope = current_rope()
        split_output, split_max, split_expsum = md.minipic_split_kv_scratch
        return dict(
            cu_seqlens_q=md.query_start_loc, seqused_k=md.seq_lens,
            max_seqlen_q=md.max_query_len, block_table=md.block_table,
            rotary_dim=rope.rotary_dim, is_neox_style=rope.is_neox_style,
            split_output=split_output, split_max=split_max, split_expsum=split_expsum,
            seq_threshold_3d=md.minipic_seq_threshold_3d, launches=md.minipic_launches,
            **span_table_args(md.minipic_tables, md.minipic_span_block_size,
                              md.minipic_quiet_bits))

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """vLLM's cache write, with span and link keys turned into their frames first.

        A batch attended by FlashAttention rows has its keys turned in forward, in the
        launch that turns its queries (one launch a layer fewer): the write waits there."""
        self._deferred_write = None  # one a failed forward left is never done later
        md = batch_metadata(layer)
        turn = getattr(md, "minipic_key_turn", None)
        if turn is not None and getattr(md, "minipic_rows", None) is not None:
            self._deferred_write = (kv_cache, slot_mapping)
            return
        super().do_kv_cache_update(layer, turn_back_tokens(key, turn), value, kv_cache,
                                   slot_mapping)

    def _new_keys(self, layer, key: torch.Tensor, value: torch.Tensor, md) -> NewKeys | None:
        """The keys of the cache write do_kv_cache_update left to forward, if it did."""
        if self._deferred_write is None:
            return None
        (kv_cache, slot_mapping), self._deferred_write = self._deferred_write, None
        turn = md.minipic_key_turn
        n = turn.cos.shape[0]  # the batch's tokens; past them, padding (no cache slot)

        def write(turned: torch.Tensor) -> None:
            super(SpanBatchImpl, self).do_kv_cache_update(layer, turned, value[:n], kv_cache,
                                                          slot_mapping[:n])

        return NewKeys(key.view(key.shape[0], -1, self.head_size), turn, write)

    def _rope_table(self, device: torch.device) -> torch.Tensor:
        """The model's fp32 cos/sin table on `device`, checked and moved once."""
        if self._cos_sin is None or self._cos_sin.device != device:
            rope = current_rope()
            problem = head_mismatch(rope, self.head_size)
            if problem:
                raise UnsupportedAttentionError(problem)
            table = rope.cos_sin(device)
            check_rope(self.head_size, rope.rotary_dim, table)
            self._cos_sin = table
        return self._cos_sin


class SpanBackend(PositionFreeTraits):
    """Mixed in before a vLLM backend: minipic's impl and builder for it, under the
    registry slot minipic registers (CUSTOM)."""

    supported_kv_cache_dtypes: ClassVar[list[str]] = list(_SUPPORTED_KV_CACHE_DTYPES)
    impl_cls: ClassVar[type]
    builder_cls: ClassVar[type]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @classmethod
    def get_impl_cls(cls) -> type:
        return cls.impl_cls

    @classmethod
    def get_builder_cls(cls) -> type:
        return cls.builder_cls

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return False  # span batches: the kernel's launch shape depends on the batch


class MiniPICFlashMetadataBuilder(SpanBatchBuilder, FlashAttentionMetadataBuilder):
    has_flash_rows = True


class MiniPICFlashImpl(SpanBatchImpl, FlashAttentionImpl):
    def run_flash_rows(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       rows, block_table: torch.Tensor, causal: bool,
                       out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One segment_plan.FlashRows call of vLLM's own FlashAttention (FA3 on Hopper)."""
        return vllm_flash_rows(q, key_cache, value_cache, rows, block_table, causal,
                               scale=self.scale, fa_version=self.vllm_flash_attn_version,
                               out=out)


class MiniPICFlashBackend(SpanBackend, FlashAttentionBackend):
    """fp16/bf16 models on GPUs FlashAttention supports."""

    impl_cls, builder_cls = MiniPICFlashImpl, MiniPICFlashMetadataBuilder


class MiniPICTritonMetadataBuilder(SpanBatchBuilder, TritonAttentionMetadataBuilder):
    pass


class MiniPICTritonImpl(SpanBatchImpl, TritonAttentionImpl):
    pass


class MiniPICTritonBackend(SpanBackend, TritonAttentionBackend):
    """Models or GPUs FlashAttention does not serve (fp32, compute capability < 8.0)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    impl_cls, builder_cls = MiniPICTritonImpl, MiniPICTritonMetadataBuilder


def flash_attention_serves(head_size: int, dtype: torch.dtype) -> bool:
    """Whether FlashAttention runs this model's attention on this GPU (else Triton)."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

    capability = current_platform.get_device_capability()
    return (dtype in (torch.float16, torch.bfloat16)
            and FlashAttentionBackend.supports_head_size(head_size)
            and capability is not None
            and FlashAttentionBackend.supports_compute_capability(capability)
            and get_flash_attn_version(head_size=head_size) is not None)  # this build has FA


def _full_decode_graphs(vllm_config, head_size: int) -> bool:
    """Whether uniform decode steps replay full graphs of the rows path: FA3 rows on Model
    Runner V2 (whose dispatch minipic checks), no mask_markers (the span kernel's), one
    data-parallel rank and no speculative decoding (one query per request)."""
    from minipic.config import is_enabled, mask_markers, span_attention

    return (is_enabled(vllm_config) and bool(getattr(vllm_config, "use_v2_model_runner", False))
            and span_attention(vllm_config) != "triton" and not mask_markers(vllm_config)
            and vllm_config.parallel_config.data_parallel_size == 1
            and vllm_config.speculative_config is None
            and _flash_attention_version(head_size) == 3)


def prefill_graphs_wanted(vllm_config, cudagraph_mode) -> bool:
    """Whether minipic captures prefill graphs (graph_dispatch.py): option
    `prefill_graphs`, full decode graphs of the rows (_full_decode_graphs) and piecewise
    graphs for the rest: vLLM's default mode FULL_AND_PIECEWISE (`cudagraph_mode`, as
    vLLM resolved it)."""
    from vllm.config.compilation import CUDAGraphMode

    from minipic.config import prefill_graphs

    return (prefill_graphs(vllm_config) and cudagraph_mode.decode_mode() == CUDAGraphMode.FULL
            and cudagraph_mode.mixed_mode() == CUDAGraphMode.PIECEWISE
            and _full_decode_graphs(vllm_config, vllm_config.model_config.get_head_size()))


def _flash_attention_version(head_size: int) -> int | None:
    try:
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
    except ImportError:
        return None
    return get_flash_attn_version(head_size=head_size)


def split_kv_cache(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views [blocks, block_size, kv_heads, head_size] of the layer's cache.

    vLLM 0.25 keeps [blocks, 2, block_size, kv_heads, head_size]; later releases
    [blocks, kv_heads, block_size, 2 * head_size]. Views only: no copies.
    """
    if kv_cache.dim() == 5:
        return kv_cache.unbind(1)
    return kv_cache.transpose(1, 2).split(head_size, dim=-1)


# Span batches of at most this many query tokens, a prefill among them and no links, take
# the span kernel under span_attention "auto" when they run eagerly (_short_prefill): a span
# hit's question is host-bound there, and the kernel is one launch a layer (bound once for
# all layers) with no plan to build, where the rows are a turn, a FlashAttention call and a
# merge over a plan (docs/attention.md, "Which path a span batch takes"). A link batch's
# kernel scores its tiles twice.
KERNEL_MAX_QUERY_TOKENS = 128


def graph_prefill_tokens(vllm_config) -> int:
    """The most tokens a prefill or mixed batch may hold and still replay CUDA graphs
    (vLLM pads it to a captured size); 0 when such batches run eagerly (enforce_eager,
    FULL_DECODE_ONLY)."""
    from vllm.config import CUDAGraphMode

    config = vllm_config.compilation_config  # its mode is set by VllmConfig.__post_init__
    if config.cudagraph_mode.mixed_mode() == CUDAGraphMode.NONE:
        return 0
    return config.max_cudagraph_capture_size or 0


def _short_prefill(layout, query_start_loc: list[int], graph_tokens: int) -> bool:
    """Whether a span batch takes the span kernel under "auto": short (at most
    KERNEL_MAX_QUERY_TOKENS), without links, and run eagerly (more tokens than
    `graph_tokens`, graph_prefill_tokens). Eager, such a step is host-bound and the
    kernel's one launch a layer beats the rows' three and their plan. Under CUDA graphs
    the host is fast and the GPU's time counts: at a hit's shapes the kernel takes
    3.1-4.4x FA3's GPU time, the rows 1.8-1.9x (docs/attention.md), and on one H100 a
    compiled 10-document hit took 23.3 ms on the rows against 25.3 on the kernel
    (0664987)."""
    tokens, requests = query_start_loc[-1], len(query_start_loc) - 1
    return (requests < tokens <= KERNEL_MAX_QUERY_TOKENS and tokens > graph_tokens
            and not layout.has_links())


def _host_extents(m) -> tuple[list[int], list[int]]:
    """Per request query start locations and sequence lengths, as host lists (the
    metadata's CPU copies: this runs for batches with markers only)."""
    query_start_loc = m.query_start_loc_cpu[: m.num_reqs + 1].tolist()
    # vLLM 0.25's host copy, exact but for async speculative decoding (refused); without it
    # the device lengths are read back (a sync; the deprecated seq_lens_cpu does the same).
    bound = getattr(m, "seq_lens_cpu_upper_bound", None)
    seq_lens = (m.seq_lens.cpu() if bound is None else bound)[: m.num_reqs].tolist()
    return query_start_loc, seq_lens


def _refuse_unsupported(impl: SpanBatchImpl) -> None:
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
            "minipic's position-free CUDA attention does not support " + "; ".join(found))
