"""bench_kernel's plot: every kernel over stock vLLM's FA3, under the names users know."""

import math

import pytest

from minipic.devtools.kernel_plot import over_baseline, plot, title


def test_times_are_over_fa3_and_missing_ones_are_gaps():
    row = {"ms": {"fa3": 0.5, "minipic": 1.5, "stock": 0.75}}
    assert over_baseline(row, "minipic") == 3.0 and over_baseline(row, "stock") == 1.5
    assert math.isnan(over_baseline(row, "minipic_noseg"))
    assert math.isnan(over_baseline({"ms": {"minipic": 1.0}}, "minipic"))  # no FA3: no ratio


def test_the_title_says_what_the_numbers_are_from():
    text = title({"gpu": "NVIDIA H200", "vllm": "0.25.1"})
    assert "stock vLLM (FA3)" in text and "NVIDIA H200" in text and "vLLM 0.25.1" in text
    assert "vLLM ?" in title({})  # unrecorded facts show as unknown


def test_a_saved_run_draws(tmp_path):
    pytest.importorskip("matplotlib")
    results = {"env": {"gpu": "NVIDIA H200", "vllm": "0.25.1"},
               "prefill": [{"q_len": q, "ms": {"fa3": 1.0, "minipic": 2.0, "stock": 1.2}}
                           for q in (128, 1024)],
               "decode": [{"num_seqs": 64, "context": c, "ms": {"fa3": 1.0, "minipic": 1.4,
                                                                "stock": 1.1}}
                          for c in (1024, 4096)]}
    plot(results, tmp_path / "ratio.png")
    assert (tmp_path / "ratio.png").stat().st_size > 10_000
