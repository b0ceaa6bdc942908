"""The benchmarks' shared set-up: the --minipic-option parser."""

from __future__ import annotations

import pytest

from minipic.devtools.bench_setup import minipic_option_pairs


def test_minipic_options_are_parsed_as_json_values():
    assert minipic_option_pairs(["mask_markers=true", "n=3", "name=x"]) == {
        "mask_markers": True, "n": 3, "name": "x"}
    assert minipic_option_pairs(None) == {}
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        minipic_option_pairs(["mask_markers"])
