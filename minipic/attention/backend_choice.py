"""Worker side: which position-free attention backend serves this platform."""

from __future__ import annotations


def position_free_backend() -> type:
    """minipic's backend for the current platform (stock backends rotate K in the cache)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from minipic.attention.torch_backend import MiniPICTorchBackend

        return MiniPICTorchBackend
    if current_platform.is_cuda():
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        from minipic.attention.flash_backend import MiniPICFlashBackend

        # vLLM resolves backends by get_name() in places (e.g. KV connectors):
        # the CUSTOM slot is its public registry entry for out-of-tree backends.
        register_backend(AttentionBackendEnum.CUSTOM,
                         f"{MiniPICFlashBackend.__module__}.{MiniPICFlashBackend.__qualname__}")
        return MiniPICFlashBackend
    raise RuntimeError(
        f"minipic has no position-free attention backend for platform "
        f"{current_platform.device_name!r}: supported are CPU (torch) and CUDA (FlashAttention and Triton)"
    )
