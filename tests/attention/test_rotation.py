"""rotation.Rotation: the lookup that skips the sign (non_negative) turns as the general one."""

from __future__ import annotations

import pytest
import torch

from minipic.attention.rotation import Rotation
from minipic.devtools.paged_attention_case import rope_table


@pytest.mark.parametrize("backwards", [False, True])
@pytest.mark.parametrize("mscale", [1.0, 1.3])
def test_non_negative_lookup_equals_the_general_one(backwards, mscale):
    table = rope_table(32, 4096, mscale=mscale)
    shifts = torch.tensor([0, 1, 7, 1000, 4095], dtype=torch.int32)
    x = torch.randn(5, 3, 32)
    general = Rotation.at(shifts, table, 32, True, backwards=backwards, pure=True)
    quick = Rotation.at(shifts, table, 32, True, backwards=backwards, pure=True,
                        non_negative=True)
    assert torch.equal(quick.apply(x), general.apply(x))
    # a turn back undoes the turn forward
    there = Rotation.at(shifts, table, 32, True, pure=True, non_negative=True).apply(x)
    back = Rotation.back(shifts, table, 32, True, non_negative=True).apply(there)
    assert torch.allclose(back, x, atol=1e-5)
