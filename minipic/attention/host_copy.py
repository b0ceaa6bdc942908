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


# Where each tensor of a joint copy starts, in bytes: Triton specializes a pointer argument
# on whether it is 16-byte aligned, so a piece whose alignment moved with the sizes of the
# pieces before it would make Triton compile a kernel again mid-run (a 150-1000 ms stall of
# every request in the step, seen in ISPS traces when plans were packed unaligned).
ALIGN_BYTES = 16


def to_device_together(tensors: list[torch.Tensor], device: torch.device | str
                       ) -> list[torch.Tensor]:
    """Host tensors on `device` in one copy per dtype (a copy costs the host tens of
    microseconds whatever its size), each a contiguous view of its copy starting
    ALIGN_BYTES-aligned; in the order given."""
    device = torch.device(device)
    if any(t.device.type != "cpu" for t in tensors):  # not host tensors: each as it is
        return [t.to(device) for t in tensors]
    moved: list[torch.Tensor | None] = [None] * len(tensors)
    for dtype in {t.dtype for t in tensors}:
        places = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        group = [tensors[i] for i in places]
        packed, starts = pack(group, pin=device.type == "cuda")
        for i, view in zip(places, unpack(packed.to(device, non_blocking=True), group, starts)):
            moved[i] = view
    return moved


def pack(tensors: list[torch.Tensor], pin: bool = False) -> tuple[torch.Tensor, list[int]]:
    """Tensors of one dtype in one flat tensor (in pinned memory if `pin`), and where each
    starts (ALIGN_BYTES-aligned)."""
    per_align = max(ALIGN_BYTES // tensors[0].element_size(), 1)
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
