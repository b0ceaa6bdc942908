"""TorchCopyWorker (the CPU platform's KV copier): whole rows each way, failures reported."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from minipic.connector.worker.torch_copy import TorchCopyWorker  # noqa: E402

PAGE = 64  # bytes of one block's page


class Region:
    """The CPU tier as the worker sees it: one [chunks, page] int8 view per KV tensor."""

    def __init__(self, chunks: int):
        self.rows = torch.zeros(chunks, PAGE, dtype=torch.int8)

    def create_next_worker_view(self, page_size_bytes: int) -> torch.Tensor:
        assert page_size_bytes == PAGE
        return self.rows

    def cleanup(self) -> None:
        pass


def ids(*block_ids: int):
    return SimpleNamespace(block_ids=list(block_ids))


def make_worker(cache_blocks: int = 6, chunks: int = 4):
    cache = torch.arange(cache_blocks * PAGE, dtype=torch.int32).to(torch.int8)
    cache = cache.view(cache_blocks, PAGE).clone()
    kv_caches = SimpleNamespace(group_data_refs=[0],
                                tensors=[SimpleNamespace(tensor=cache, page_size_bytes=PAGE)])
    region = Region(chunks)
    return TorchCopyWorker(kv_caches, region), cache, region


def test_blocks_round_trip_through_the_cpu_tier():
    worker, cache, region = make_worker()
    original = cache.clone()
    assert worker.submit_store(1, ids(4, 1), ids(0, 3))
    assert torch.equal(region.rows[0], original[4]) and torch.equal(region.rows[3], original[1])
    cache.zero_()
    assert worker.submit_load(2, ids(3, 0), ids(2, 5))
    assert torch.equal(cache[2], original[1]) and torch.equal(cache[5], original[4])
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True), (2, True)]


def test_a_failed_copy_is_a_failed_job_not_an_exception():
    worker, _, _ = make_worker(chunks=4)
    assert worker.submit_load(7, ids(9), ids(0))  # CPU chunk 9 of 4
    assert worker.submit_store(8, ids(0, 1), ids(2))  # two blocks, one target
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(7, False), (8, False)]
