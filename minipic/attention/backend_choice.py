"""Worker side: which position-free attention backend serves this platform and model."""

from __future__ import annotations

import torch


def position_free_backend(head_size: int, dtype: torch.dtype) -> type:
    """minipic's backend for the current platform: stock attention for batches without
    markers, span frames and rules for batches with them."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from minipic.attention.torch_backend import MiniPICTorchBackend

        return MiniPICTorchBackend
    if current_platform.is_cuda():
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        from minipic.attention import cuda_backend

        backend = (cuda_backend.MiniPICFlashBackend
                   if cuda_backend.flash_attention_serves(head_size, dtype)
                   else cuda_backend.MiniPICTritonBackend)
        # vLLM resolves backends by get_name() in places (e.g. KV connectors):
        # the CUSTOM slot is its public registry entry for out-of-tree backends.
        register_backend(AttentionBackendEnum.CUSTOM,
                         f"{backend.__module__}.{backend.__qualname__}")
        return backend
    raise RuntimeError(
        f"minipic has no position-free attention backend for platform "
        f"{current_platform.device_name!r}: supported are CPU (torch) and CUDA "
        "(FlashAttention, Triton)")
