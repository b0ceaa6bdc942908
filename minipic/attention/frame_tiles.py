"""Frame tiles: a batch's keys cut into tiles that each lie in one frame (host side).

The span kernel (triton_kernel.py) reads keys in tiles. A span's keys are stored in the
span's own frame (span_layout.SpanLayout.frame_offset), so a tile of fixed-size, aligned
key ranges can straddle two frames, and the kernel must turn every key of it forward by
its own offset: a gather of cos/sin rows, fp32 math and a register round trip per key,
which kept K out of Triton's pipelined loads (a 33-token question over 40k cached keys:
0.65 ms a layer on an H200 where FlashAttention takes 0.09, docs/attention.md).

Frame tiles end where a frame (or a span) ends. Within one, every key needs the same
turn, so the kernel turns the query block back into the tile's frame instead, once each
time the frame changes: about once a span. Runs start at block boundaries (markers start
blocks), so every tile starts at one too; a run's last tile is short.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from minipic.attention.host_copy import to_device

# Keys a frame tile holds at most: the kernel's key tile (triton_kernel.FRAME_TILE).
TILE_KEYS = 64


@dataclasses.dataclass(frozen=True)
class FrameTiles:
    """Per request r: count[r] tiles, tile t its keys [start[r, t], end[r, t]); int32."""

    start: torch.Tensor  # [reqs, tiles]
    end: torch.Tensor  # [reqs, tiles]
    count: torch.Tensor  # [reqs]
    keys: int = TILE_KEYS  # keys a tile holds at most

    def to(self, device: torch.device | str) -> "FrameTiles":
        return FrameTiles(to_device(self.start, device), to_device(self.end, device),
                          to_device(self.count, device), self.keys)


def frame_tiles(frame_offset: torch.Tensor, span_of: torch.Tensor, seq_lens: list[int],
                block_size: int, keys: int = TILE_KEYS) -> FrameTiles:
    """The frame tiles of a batch's first seq_lens[r] keys, from its layout's per-block
    frame_offset and span_of [reqs, blocks] (host tensors). A run is a stretch of blocks
    with one frame offset and one span; it is cut into tiles of `keys` keys from its start."""
    frames, spans = frame_offset.numpy(), span_of.numpy()
    lens = np.asarray(seq_lens, dtype=np.int64)
    reqs, width = frames.shape
    blocks = -(-lens // block_size)  # [reqs] blocks holding keys
    if int(blocks.max(initial=0)) > width:
        raise ValueError(f"the layout holds {width} blocks a request, a sequence needs "
                         f"{int(blocks.max())}")
    column = np.arange(width)
    used = column[None, :] < blocks[:, None]
    changed = np.ones((reqs, width), dtype=bool)
    changed[:, 1:] = (frames[:, 1:] != frames[:, :-1]) | (spans[:, 1:] != spans[:, :-1])
    row, first_block = np.nonzero(changed & used)  # runs, in row-major order
    last_of_row = np.append(row[1:] != row[:-1], True)
    next_block = np.where(last_of_row, blocks[row], np.append(first_block[1:], 0))
    run_start = first_block * block_size
    run_end = np.minimum(next_block * block_size, lens[row])
    tiles_of_run = -(-(run_end - run_start) // keys)
    run = np.repeat(np.arange(row.size), tiles_of_run)
    first_tile_of_run = np.cumsum(tiles_of_run) - tiles_of_run
    start = run_start[run] + (np.arange(run.size) - first_tile_of_run[run]) * keys
    end = np.minimum(start + keys, run_end[run])
    count = np.bincount(row[run], minlength=reqs)
    first_tile_of_row = np.cumsum(count) - count
    place = np.arange(run.size) - first_tile_of_row[row[run]]
    # a row of a multiple of 4 tiles: `end` starts 16-byte aligned, as Triton specializes
    width = -(-max(int(count.max(initial=0)), 1) // 4) * 4
    table = np.zeros((2, reqs, width), dtype=np.int32)
    table[0, row[run], place] = start
    table[1, row[run], place] = end
    table = torch.from_numpy(table)
    return FrameTiles(table[0], table[1], torch.from_numpy(count.astype(np.int32)), keys)
