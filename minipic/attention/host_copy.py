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


# Where each tensor of a joint copy starts, in bytes: Triton specializes a kernel on its
# pointers being 16-byte aligned, so a table read at another alignment would compile anew.
_ALIGN_BYTES = 16


def to_device_together(tensors: list[torch.Tensor], device: torch.device | str
                       ) -> list[torch.Tensor]:
    """Host tensors of one dtype on `device` in one copy (each a contiguous view of the
    copy, starting 16-byte aligned): a copy costs the host tens of microseconds whatever
    its size. Otherwise each as to_device moves it."""
    device = torch.device(device)
    if (device.type != "cuda" or len({t.dtype for t in tensors}) != 1
            or any(t.device.type != "cpu" for t in tensors)):
        return [to_device(t, device) for t in tensors]
    packed, starts = pack(tensors, pin=True)
    return unpack(packed.to(device, non_blocking=True), tensors, starts)


def pack(tensors: list[torch.Tensor], pin: bool = False) -> tuple[torch.Tensor, list[int]]:
    """Tensors of one dtype in one flat tensor (in pinned memory if `pin`), and where each
    starts (16-byte aligned)."""
    per_align = max(_ALIGN_BYTES // tensors[0].element_size(), 1)
    starts, size = [], 0
    for t in tensors:
        starts.append(size)
        size += -(-t.numel() // per_align) * per_align
    packed = torch.empty(size, dtype=tensors[0].dtype, pin_memory=pin)
    for t, view in zip(tensors, unpack(packed, tensors, starts)):
        view.copy_(t)
    return packed, starts


def unpack(packed: torch.Tensor, like: list[torch.Tensor], starts: list[int]
           ) -> list[torch.Tensor]:
    """Views of `packed` shaped as `like`, from `starts` (pack)."""
    return [packed[start: start + t.numel()].view(t.shape) for t, start in zip(like, starts)]
