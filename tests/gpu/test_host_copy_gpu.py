"""A span layout's int32 tables reach the GPU in one copy (host_copy.to_device_together),
each where Triton finds its pointer 16-byte aligned, as the span kernel's start-up warm-up
launched it (else the first span batch would compile the kernel anew)."""

from __future__ import annotations

import pytest
import torch

from minipic.devtools.paged_attention_case import epic_markers, marker_layout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_a_layouts_tables_share_one_copy_each_aligned():
    host = marker_layout([epic_markers(3, 5, 1, 2), "-S-P"], 23, 16)  # 23 blocks: odd sizes
    moved = host.to("cuda")
    tables = [moved.span_of, moved.context_pos, moved.shift, moved.frame_offset,
              moved.links_end, moved.link_tokens]
    assert len({t.untyped_storage().data_ptr() for t in tables}) == 1
    for table, original in zip(tables, [host.span_of, host.context_pos, host.shift,
                                        host.frame_offset, host.links_end, host.link_tokens]):
        assert table.data_ptr() % 16 == 0 and table.is_contiguous()
        assert torch.equal(table.cpu(), original)
