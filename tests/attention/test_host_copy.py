"""host_copy.pack: a span batch's tables leave the host in one copy, each table where
Triton finds its pointer 16-byte aligned (else the span kernel would compile anew)."""

from __future__ import annotations

import torch

from minipic.attention.host_copy import pack, to_device_together, unpack


def test_pack_keeps_every_table_and_aligns_each():
    tables = [torch.arange(6, dtype=torch.int32).view(2, 3),  # 24 bytes: padded to 32
              torch.tensor([7, 8], dtype=torch.int32),
              torch.arange(10, dtype=torch.int32).view(5, 2).t()]  # not contiguous
    packed, starts = pack(tables)
    assert starts == [0, 8, 12]
    for start in starts:
        assert start * packed.element_size() % 16 == 0
    for view, table in zip(unpack(packed, tables, starts), tables):
        assert view.shape == table.shape and view.is_contiguous()
        assert torch.equal(view, table)


def test_tables_of_several_dtypes_keep_their_values_and_order():
    tables = [torch.ones(3, dtype=torch.int32), torch.tensor([True, False]),
              torch.zeros(2, 2, dtype=torch.int32)]
    moved = to_device_together(tables, "cpu")
    assert all(torch.equal(m, t) for m, t in zip(moved, tables))
