"""Where one request's time to first token went, from vLLM's own request timestamps.

With stats on (`disable_log_stats=False`) a RequestOutput's `metrics` carries the engine
core's time.monotonic() stamps of the request entering the scheduler's queue, being
scheduled and its first token's batch coming out. CLOCK_MONOTONIC is one clock for every
process of the host, so with the caller's own stamps around the call the wall time splits,
unsampled and unprofiled, into:
  to_queue:    the front end (input processing), the hop to the engine core, its input
               thread (the request and its block hashes made) and the wait for the main loop;
  to_schedule: queued until a scheduler step took it (prefix-cache and connector lookups);
  step:        that step: inputs, attention metadata, the forward and sampling;
  to_return:   the output's way back to the caller.
"""

from __future__ import annotations

STAGES = ("to_queue", "to_schedule", "step", "to_return")


def request_stages(begin: float, end: float, metrics) -> dict[str, float] | None:
    """Seconds per stage of one request sent at `begin` and returned at `end`
    (time.monotonic()); None when its output has no engine timestamps (stats off)."""
    queued = getattr(metrics, "queued_ts", 0.0)
    scheduled = getattr(metrics, "scheduled_ts", 0.0)
    first = getattr(metrics, "first_token_ts", 0.0)
    if not (begin <= queued <= scheduled <= first <= end):
        return None
    return dict(zip(STAGES, (queued - begin, scheduled - queued, first - scheduled,
                             end - first)))
