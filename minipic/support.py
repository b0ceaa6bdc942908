"""Start-up refusal: configurations minipic would get silently wrong.

Checked in the engine-core process before workers start, so a bad config fails
fast with a message naming the model feature. Workers check the rotary
embedding itself (`minipic.attention.rope`), which catches what config fields
cannot show.
"""

from __future__ import annotations

from typing import Any

# Compilation passes (vLLM pass-config names) that fuse RoPE into the KV cache write:
# the write would skip minipic's turn of span keys into their frames (attention/links.py).
_ROPE_KV_FUSIONS = ("fuse_rope_kvcache", "fuse_qk_norm_rope_kvcache")


class UnsupportedModelError(ValueError):
    """minipic cannot serve this model/config correctly."""


def model_problems(vllm_config: Any) -> list[str]:
    """Reasons (empty when supported) why positional-free KV would be wrong here."""
    mc = vllm_config.model_config
    text = mc.hf_text_config
    checks = {
        "multi-head latent attention (MLA): its keys are compressed and partly "
        "position-free already, minipic only handles per-head RoPE": mc.use_mla,
        "multimodal RoPE (M-RoPE): positions are 3-D, not a token index": mc.uses_mrope,
        "sliding-window attention: a span's keys would fall out of the window "
        "depending on where it is placed": mc.get_sliding_window() is not None
        or bool(getattr(text, "layer_types", None) and "sliding_attention" in text.layer_types),
        "chunked local attention": bool(getattr(text, "attention_chunk_size", None)),
        "dual-chunk attention": bool(getattr(text, "dual_chunk_attention_config", None)),
        "encoder-decoder models": mc.is_encoder_decoder,
        "multimodal prefix-LM attention: image ranges attend both ways, minipic's "
        "attention is causal only": bool(getattr(mc, "is_mm_prefix_lm", False)),
        "R-SWA (evicted middle blocks are masked by stock attention, not by minipic's)":
        getattr(mc, "rswa_window", None) is not None,
        "hybrid attention/state-space models: their state is not positional KV": mc.is_hybrid,
        f"kv_cache_dtype={vllm_config.cache_config.cache_dtype!r}: only 'auto' is "
        "supported": vllm_config.cache_config.cache_dtype != "auto",
        "speculative decoding: the draft model is not checked for RoPE": vllm_config.speculative_config
        is not None,
        f"runner type {mc.runner_type!r} (pooling/embedding models may use bidirectional "
        "attention layers minipic does not replace): only 'generate'": mc.runner_type != "generate",
        "decode context parallelism: hash blocks span several KV blocks": getattr(
            vllm_config.parallel_config, "decode_context_parallel_size", 1) > 1,
        "prefill context parallelism: hash blocks span several KV blocks": getattr(
            vllm_config.parallel_config, "prefill_context_parallel_size", 1) > 1,
        "Inductor graph partition: it captures the KV cache update, where minipic turns "
        "span and link keys into their frames (attention.links); use vLLM's default "
        "splitting": bool(getattr(
            vllm_config.compilation_config, "use_inductor_graph_partition", False)),
        "compilation splitting_ops without vllm::unified_kv_cache_update: a CUDA graph "
        "piece would replay the KV cache update with the turn of span and link keys into "
        "their frames of the batch it was captured with": _kv_update_captured(vllm_config),
        "breakable CUDA graphs (VLLM_USE_BREAKABLE_CUDAGRAPH, which vLLM also turns on by "
        "itself for some models): their segments break at attention, not at the KV cache "
        "update, so they would replay the cache write of the batch they were captured with "
        "(span and link keys not turned into their frames); set "
        "VLLM_USE_BREAKABLE_CUDAGRAPH=0 or use enforce_eager":
        _breakable_graphs_hold_kv_update(vllm_config),
    }
    problems = [reason for reason, present in checks.items() if present]
    problems += _connector_problems(vllm_config)
    pass_config = vllm_config.compilation_config.pass_config
    problems += [
        f"compilation pass {name}: it fuses RoPE into the KV cache write, which would skip "
        "minipic's turn of span keys into their frames; turn it off"
        for name in _ROPE_KV_FUSIONS if getattr(pass_config, name, False)
    ]
    return problems


def _kv_update_captured(vllm_config: Any) -> bool:
    """Whether CUDA graph pieces would hold the KV cache update (a user's splitting_ops)."""
    from vllm.config import CompilationMode
    from vllm.platforms import current_platform

    cc = vllm_config.compilation_config
    contains = getattr(cc, "splitting_ops_contain_kv_cache_update", None)
    return (current_platform.is_cuda() and cc.mode == CompilationMode.VLLM_COMPILE
            and contains is not None and not contains())


def _breakable_graphs_hold_kv_update(vllm_config: Any) -> bool:
    """Whether vLLM's breakable CUDA graphs (no torch.compile splitting) would capture it."""
    import vllm.envs as envs
    from vllm.platforms import current_platform

    breakable = bool(getattr(envs, "VLLM_USE_BREAKABLE_CUDAGRAPH", False))
    mode = vllm_config.compilation_config.cudagraph_mode
    return (current_platform.is_cuda() and breakable and mode is not None
            and mode.has_piecewise_cudagraphs())


def _connector_problems(vllm_config: Any) -> list[str]:
    """Only minipic's own connector may move this instance's KV blocks: span blocks
    hold K rotated in their span's frame, stock vLLM's blocks at their positions, so a
    stock store or transfer could hand one kind to the other."""
    from minipic.config import CONNECTOR_NAME

    kv = getattr(vllm_config, "kv_transfer_config", None)
    name = getattr(kv, "kv_connector", None)
    if not name or name == CONNECTOR_NAME:
        return []
    return [f"kv_connector {name!r}: it would share or load KV blocks that stock vLLM "
            f"instances read with keys at their positions, not in span frames; use "
            f"{CONNECTOR_NAME} (docs/connector.md)"]


def check_supported(vllm_config: Any) -> None:
    problems = model_problems(vllm_config)
    if problems:
        mc = vllm_config.model_config
        raise UnsupportedModelError(
            f"minipic cannot serve {mc.model} ({', '.join(mc.architectures)}): "
            + "; ".join(problems)
        )
