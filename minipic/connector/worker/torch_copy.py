"""TorchCopyWorker: moves KV blocks between the KV cache and the CPU tier with
plain torch indexing.

vLLM's CPUOffloadingWorker needs device streams and swap_blocks kernels, so it
refuses the CPU platform. There the "device" cache is host memory already and
a copy is an indexed assignment, done synchronously: the next forward must
see loaded blocks anyway, and stores read blocks the last forward finished.

Per KV tensor (vLLM's canonical view: int8 rows, one per block, K and V of
every head in whatever order the attention backend keeps them) the CPU tier
holds one row per chunk in this worker's slice of the shared mmap; rows are
copied whole, so the byte layout inside a block is the backend's and is part
of the store namespace.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)


logger = logging.getLogger("vllm.minipic.connector")  # shares vLLM's handlers


def _block_rows(tensor: torch.Tensor, page_size_bytes: int) -> torch.Tensor:
    """[num_blocks, page_size_bytes] int8 view of a canonical KV tensor."""
    if tensor.dtype == torch.int8 and tensor.dim() == 2:
        return tensor
    return tensor.view(torch.int8).view(-1, page_size_bytes)


def _ids(spec: BlockIDsLoadStoreSpec) -> torch.Tensor:
    return torch.from_numpy(np.asarray(spec.block_ids, dtype=np.int64))


class TorchCopyWorker(OffloadingWorker):
    def __init__(self, kv_caches: Any, region: Any):
        if len(kv_caches.group_data_refs) != 1:
            raise NotImplementedError("TorchCopyWorker handles one KV cache group")
        self._region = region  # owned: released at shutdown
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (cache rows, CPU-tier rows)
        for t in kv_caches.tensors:
            cache_rows = _block_rows(t.tensor, t.page_size_bytes)
            self._pairs.append((cache_rows, region.create_next_worker_view(t.page_size_bytes)))
        self._row_bytes = sum(t.page_size_bytes for t in kv_caches.tensors)
        self._finished: list[TransferResult] = []

    def _copy(self, job_id: int, src_ids: torch.Tensor, dst_ids: torch.Tensor,
              to_cpu_tier: bool) -> bool:
        start = time.perf_counter()
        try:
            if len(src_ids) != len(dst_ids):
                raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} targets")
            for cache_rows, tier_rows in self._pairs:
                if to_cpu_tier:
                    tier_rows[dst_ids] = cache_rows[src_ids]
                else:
                    cache_rows[dst_ids] = tier_rows[src_ids]
        except Exception as e:  # a failed job: vLLM recomputes (load) or forgets (store) it
            logger.error("minipic: KV copy job %d failed: %s", job_id, e)
            self._finished.append(TransferResult(job_id=job_id, success=False))
            return True
        self._finished.append(TransferResult(
            job_id=job_id, success=True, transfer_size=len(src_ids) * self._row_bytes,
            transfer_time=time.perf_counter() - start))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        return self._copy(job_id, _ids(src_spec), _ids(dst_spec), to_cpu_tier=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec,
                    dst_spec: GPULoadStoreSpec) -> bool:
        return self._copy(job_id, _ids(src_spec), _ids(dst_spec), to_cpu_tier=False)

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        return  # copies complete inside submit_*

    def shutdown(self) -> None:
        self._pairs.clear()
        if self._region is not None:
            self._region.cleanup()
            self._region = None
