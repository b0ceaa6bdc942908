"""When the engine may idle with tier transfers in flight (idle_during_stores.py), on the
tiering manager's job shapes of both vLLM versions. The engine-level behaviour is
tests/connector/test_engines.py::test_the_engine_idles_while_only_disk_writes_are_in_flight."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import ReqContext  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402
from vllm.v1.kv_offload.tiering.manager import JobMetadata  # noqa: E402

from minipic.connector.compat import tiering_needs_steps  # noqa: E402
from minipic.connector.scheduler.idle_during_stores import IdleDuringDiskStores  # noqa: E402

CTX = ReqContext(req_id="r")


def tier(busy: bool = False, bp_detector=None):
    return SimpleNamespace(has_pending_work=lambda: busy, bp_detector=bp_detector)


def manager_032(*promotions: bool, cascades: int = 0, tiers=None):
    """0.32's shape: _jobs {id: JobMetadata(transfer_job, tier_idx)}, _req_state."""
    jobs = {i: JobMetadata(TransferJob(i, [], np.zeros(0, np.int64), p, CTX), 0)
            for i, p in enumerate(promotions)}
    state = SimpleNamespace(pending_cascade_keys=[object()] * cascades)
    return SimpleNamespace(_jobs=jobs, _req_state={"r": state}, secondary_tiers=tiers or [tier()],
                           has_pending_work=lambda: True)


def manager_025(*promotions: bool, tiers=None):
    """0.25's shape: _transfer_jobs {id: JobMetadata(..., is_promotion, ...)}."""
    jobs = {i: SimpleNamespace(is_promotion=p) for i, p in enumerate(promotions)}
    return SimpleNamespace(_transfer_jobs=jobs, secondary_tiers=tiers or [tier()],
                           has_pending_work=lambda: True)


@pytest.mark.parametrize("make", [manager_032, manager_025])
def test_stores_alone_need_no_steps_loads_do(make):
    assert not tiering_needs_steps(make())
    assert not tiering_needs_steps(make(False, False))  # two stores in flight
    assert tiering_needs_steps(make(False, True))  # a load a request waits for
    assert tiering_needs_steps(make(tiers=[tier(busy=True)]))  # the tier's own work


def test_cascades_not_yet_handed_to_a_tier_need_steps():
    assert tiering_needs_steps(manager_032(False, cascades=1))


@pytest.mark.parametrize("make", [manager_032, manager_025])
def test_a_back_pressure_detector_keeps_the_stock_rule(make):
    """It times a store until its collection: collected after an idle spell, a store would
    read as slow and turn the tier's stores off."""
    assert tiering_needs_steps(make(False, tiers=[tier(bp_detector=object())]))


def test_an_unknown_shape_keeps_the_stock_rule():
    manager = SimpleNamespace(secondary_tiers=[], has_pending_work=lambda: True)
    assert tiering_needs_steps(manager)
    assert IdleDuringDiskStores(manager).has_pending_work()
    assert not IdleDuringDiskStores(manager_032(False)).has_pending_work()
