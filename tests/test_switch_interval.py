"""The GIL's switch interval minipic sets in its engine processes (minipic/switch_interval.py):
in the engine core too, where the input thread runs (the worker's is checked through a real
engine in test_engine_stock_equivalence.py), and never in the user's own process."""

from __future__ import annotations

import sys

import pytest
from conftest import MINIPIC_ON, engine_kwargs

from minipic import _vllm_patches
from minipic.switch_interval import apply_switch_interval


@pytest.fixture
def minipic_config(tiny_model):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(**engine_kwargs(tiny_model, **MINIPIC_ON)).create_engine_config()


@pytest.fixture
def python_interval():
    """Python's interval before and after the test."""
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(0.005)


def test_the_engine_core_sets_it_before_its_kv_caches(minipic_config, python_interval,
                                                      monkeypatch):
    from vllm.v1.engine.core import EngineCore

    # the hook notes the engine core's span protocol here: this process is no engine core
    monkeypatch.setattr(_vllm_patches, "_engine_core_protocol", None)
    with pytest.raises(AttributeError):  # no engine behind `self`: vLLM's own part fails
        EngineCore._initialize_kv_caches(object(), minipic_config)
    assert sys.getswitchinterval() == pytest.approx(0.0002)


def test_the_users_own_process_keeps_its_interval(minipic_config, python_interval,
                                                  monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    apply_switch_interval(minipic_config)
    assert sys.getswitchinterval() == pytest.approx(0.005)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    apply_switch_interval(minipic_config)
    assert sys.getswitchinterval() == pytest.approx(0.0002)
