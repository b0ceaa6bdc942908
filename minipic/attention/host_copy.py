"""Worker side: host tensors to the GPU without waiting for it.

A copy from pageable host memory makes the host wait for the GPU's queue; through pinned
memory it is queued like a kernel, so the builder of the next step (vLLM's asynchronous
scheduling) does not wait for the step that runs."""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device`; host to GPU through pinned memory, without waiting."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
