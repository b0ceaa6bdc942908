"""MiniPICOffloadingSpec: vLLM's tiering spec (CPU primary + secondary tiers)
with minipic's disk tier and a plain-torch copier for platforms vLLM's CPU
offloading worker does not run on.

Used on both sides: the scheduler asks it for the manager (CPU tier + disk
tier, see `scheduler/`), each worker for the KV copier (see `worker/`).
Everything else is vLLM's: lookups keyed by block hash, promotion from disk
through the CPU tier, LRU/ARC on the CPU tier; the manager only loses the
stores of blocks the disk tier already holds (scheduler/skip_known_blocks.py).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from minipic.connector import compat
from minipic.connector.options import ConnectorConfigError, TIER_TYPE

logger = logging.getLogger("vllm.minipic.connector")  # shares vLLM's handlers

# vLLM 0.25's tier factory has no out-of-tree hook but registration; importing
# this module (the factory imports it by spec_module_path) registers the tier
# in every process that builds the spec or its metrics.
try:
    SecondaryTierFactory.register_tier(
        TIER_TYPE, "minipic.connector.scheduler.disk_tier", "MiniPICDiskTier")
except ValueError:
    pass  # already registered in this process


def has_native_copy_kernels() -> bool:
    """Where vLLM's own CPU offloading worker runs (its swap_blocks kernels)."""
    from vllm.platforms import current_platform

    return current_platform.is_cuda_alike() or current_platform.is_xpu()


class MiniPICOffloadingSpec(TieringOffloadingSpec):
    def __init__(self, *args: Any) -> None:
        # 0.25: (vllm_config, kv_cache_config); 0.32: (OffloadingConfig,)
        super().__init__(*args)
        if compat.blocks_per_chunk(self) != 1:
            raise ConnectorConfigError("MiniPICConnector stores one block per chunk")
        self._minipic_manager: Any = None

    def get_manager(self) -> Any:
        if self._minipic_manager is None:
            from minipic.connector.scheduler.disk_tier import MiniPICDiskTier
            from minipic.connector.scheduler.idle_during_stores import IdleDuringDiskStores
            from minipic.connector.scheduler.skip_known_blocks import SkipKnownBlocks

            try:
                manager = super().get_manager()
            finally:  # every process that shares the CPU tier has it mapped (compat.py)
                path = compat.release_cpu_tier_name(self)
                if path is not None:
                    logger.info("minipic: unlinked %s, mapped by every engine process; its "
                                "memory goes with the last of them", path)
            disk = [t for t in getattr(manager, "secondary_tiers", ())
                    if isinstance(t, MiniPICDiskTier)]
            self._minipic_manager = SkipKnownBlocks(IdleDuringDiskStores(manager),
                                                    disk[0].not_held) if disk else manager
        return self._minipic_manager

    def get_worker(self, kv_caches: Any) -> Any:
        if self._worker is None:
            if has_native_copy_kernels():
                self._worker = self.create_worker(kv_caches)  # vLLM's, per version
            else:
                from minipic.connector.worker.torch_copy import TorchCopyWorker

                self._worker = TorchCopyWorker(kv_caches, compat.open_worker_region(self))
            compat.disown_cpu_tier_name(self._worker)  # the scheduler unlinks it, at start-up
        return self._worker
