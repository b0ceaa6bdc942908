"""minipic.devtools.request_stages: one request's wall time split by vLLM's timestamps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from minipic.devtools.request_stages import request_stages


def stamps(queued: float, scheduled: float, first: float) -> SimpleNamespace:
    """The three fields of vLLM's RequestStateStats that the split reads."""
    return SimpleNamespace(queued_ts=queued, scheduled_ts=scheduled, first_token_ts=first)


def test_the_stages_add_up_to_the_wall_time():
    stages = request_stages(10.0, 10.1, stamps(10.01, 10.03, 10.09))
    assert stages == pytest.approx(dict(to_queue=0.01, to_schedule=0.02, step=0.06,
                                        to_return=0.01))
    assert sum(stages.values()) == pytest.approx(0.1)


@pytest.mark.parametrize("metrics", [
    None,  # stats off: RequestOutput.metrics is None
    stamps(0.0, 0.0, 0.0),  # no events reached the front end
    stamps(9.0, 10.03, 10.09),  # queued before the call: another clock, or another request
    stamps(10.01, 10.03, 10.2),  # first token after the call returned
])
def test_a_request_without_consistent_stamps_has_no_split(metrics):
    assert request_stages(10.0, 10.1, metrics) is None
