"""The store namespace of this engine, read off vLLM's config (scheduler side).

Includes everything that changes what a block's bytes mean; see
`minipic.connector.store.namespace`. The model is identified by name,
revision and its HF config: a different checkpoint published under the same
name, revision and config needs its own store directory.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from minipic.config import mask_markers, span_scale
from minipic.protocol import SpanProtocol

# Keys of an HF config that say nothing about the weights' meaning.
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "_commit_hash")


def model_fingerprint(model_config: Any) -> str:
    config = model_config.hf_config.to_dict()
    for key in _VOLATILE_CONFIG_KEYS:
        config.pop(key, None)
    text = json.dumps(config, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def kv_layout(vllm_config: Any, kv_cache_config: Any, connector_cls: Any) -> dict[str, Any]:
    """How a block's KV bytes are laid out: device family, the connector-imposed
    cache layout, and per group the shape of one page."""
    from vllm.platforms import current_platform

    groups = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        groups.append({
            "spec": type(spec).__name__,
            "block_size": spec.block_size,
            "num_kv_heads": getattr(spec, "num_kv_heads", None),
            "head_size": getattr(spec, "head_size", None),
            "dtype": str(getattr(spec, "dtype", "")).removeprefix("torch."),
            "page_size_bytes": spec.page_size_bytes,
            "layers": list(group.layer_names),
        })
    parallel = vllm_config.parallel_config
    import vllm

    layout = {
        # Cache tensor layouts differ between vLLM releases (0.25: [blocks, 2, ...],
        # 0.32: [blocks, heads, ..., 2 * head]); quantized weights give other KV.
        "vllm_version": vllm.__version__,
        "quantization": vllm_config.model_config.quantization,
        "device": current_platform.device_type,
        "connector_layout": connector_cls.get_required_kvcache_layout(vllm_config),
        "cache_layout": getattr(vllm_config.cache_config, "kv_cache_layout", None),
        "tensor_parallel_size": parallel.tensor_parallel_size,
        "pipeline_parallel_size": parallel.pipeline_parallel_size,
        "groups": groups,
    }
    # On 0.25 this variable overrides the connector's layout (NHD vs HND pages) and the
    # config does not record the result; only when set, so default stores keep their name.
    env_layout = os.environ.get("VLLM_KV_CACHE_LAYOUT")
    if env_layout:
        layout["env_kv_cache_layout"] = env_layout
    # Hidden marker keys, taking no room, change every later key's value: only when set,
    # as above (stores of earlier versions of the option: True, "hidden, taking no room").
    if mask_markers(vllm_config):
        layout["mask_markers"] = "hidden outside their span, taking no room"
    # A query outside spans weighting span keys by span_scale changes the KV of every link
    # and task block after them (not the spans'): only when set, as above.
    if span_scale(vllm_config) != 1.0:
        layout["span_scale"] = span_scale(vllm_config)
    return layout


def engine_namespace_fields(vllm_config: Any, kv_cache_config: Any, protocol: SpanProtocol,
                            connector_cls: Any) -> dict[str, Any]:
    from minipic.connector.store.namespace import namespace_fields as fields

    mc, cc = vllm_config.model_config, vllm_config.cache_config
    dtype = mc.dtype if cc.cache_dtype == "auto" else cc.cache_dtype
    return fields(
        model=f"{mc.model}@{mc.revision or 'default'}",
        model_fingerprint=model_fingerprint(mc),
        dtype=str(dtype).removeprefix("torch."),
        block_size=cc.block_size,
        kv_layout=kv_layout(vllm_config, kv_cache_config, connector_cls),
        hash_algo=cc.prefix_caching_hash_algo,
        span_protocol=protocol.to_dict(),
    )
