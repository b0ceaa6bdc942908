"""Configurations minipic cannot serve fail at LLM(...) with a message saying why.

All checks run in the caller's process before any engine process starts, so
these tests are fast.
"""

from __future__ import annotations

import json

import pytest
from conftest import MINIPIC_ON, start_llm

from minipic.config import connector_config
from minipic.hashing.block_hasher import UnsupportedHashAlgoError
from minipic.protocol import SpanProtocolError
from minipic.support import UnsupportedModelError


def test_fp8_kv_cache_is_refused(tiny_model):
    with pytest.raises(UnsupportedModelError, match="kv_cache_dtype='fp8'"):
        start_llm(tiny_model, kv_cache_dtype="fp8", **MINIPIC_ON)


def test_non_deterministic_hash_algo_is_refused(tiny_model):
    with pytest.raises(UnsupportedHashAlgoError, match="xxhash"):
        start_llm(tiny_model, prefix_caching_hash_algo="xxhash", **MINIPIC_ON)


def test_sliding_window_model_is_refused(tmp_path):
    from transformers import MistralConfig

    from minipic.devtools.tiny_llama import build_tokenizer

    build_tokenizer(tmp_path)
    MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, sliding_window=64,
                  max_position_embeddings=1024).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="sliding-window attention"):
        start_llm(str(tmp_path), **MINIPIC_ON)


def test_another_kv_connector_is_refused(tiny_model):
    offload = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    with pytest.raises(UnsupportedModelError, match="kv_connector 'OffloadingConnector'"):
        start_llm(tiny_model, kv_transfer_config=offload, **MINIPIC_ON)


def test_enabled_must_be_a_boolean(tiny_model):
    with pytest.raises(ValueError, match="enabled must be true or false"):
        start_llm(tiny_model, additional_config={"minipic": {"enabled": "false"}})


def test_conflicting_marker_ids_are_refused(tiny_model):
    bad = {"additional_config": {"minipic": {"ssep_token_id": 3, "pdep_token_id": 3,
                                             "pad_token_id": 5}}}
    with pytest.raises(SpanProtocolError, match="different"):
        start_llm(tiny_model, **bad)


def test_tokenizer_without_reserved_tokens_asks_for_ids(tiny_model, tmp_path):
    import shutil

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny_model}/{name}", tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("additional_special_tokens", None)
    config.pop("extra_special_tokens", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = json.loads((tmp_path / "tokenizer.json").read_text())
    tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if "reserved" not in t["content"]]
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(SpanProtocolError, match="ssep_token_id"):
        start_llm(str(tmp_path), **MINIPIC_ON)


def test_callers_config_dict_is_not_modified(tiny_model):
    """minipic pins the resolved marker ids into vLLM's config, never into the caller's dict."""
    from vllm.engine.arg_utils import EngineArgs

    from conftest import engine_kwargs

    additional = {"minipic": {}}
    config = EngineArgs(**engine_kwargs(tiny_model, additional_config=additional)).create_engine_config()
    assert additional == {"minipic": {}}
    assert config.additional_config["minipic"] == {"ssep_token_id": 3, "pdep_token_id": 4,
                                                   "pad_token_id": 5, "link_token_id": 6}


def test_switch_changes_the_compile_cache_key(tiny_model):
    """A torch.compile graph cached without minipic must never be reused with it."""
    from vllm.engine.arg_utils import EngineArgs

    from conftest import engine_kwargs

    def key(**overrides):
        return EngineArgs(**engine_kwargs(tiny_model, **overrides)).create_engine_config().compute_hash()

    assert key() == key()
    assert key(**MINIPIC_ON) != key()


@pytest.mark.parametrize("feature, reason", [("is_mm_prefix_lm", "prefix-LM"),
                                             ("rswa_window", "R-SWA")])
def test_attention_masks_minipic_does_not_apply_are_refused(tiny_model, monkeypatch, feature,
                                                            reason):
    """Model features no tiny CPU model has: the tiny model's config, with the one field
    that vLLM derives from the architecture set as such a model would set it."""
    from vllm.engine.arg_utils import EngineArgs

    from conftest import engine_kwargs
    from minipic.support import model_problems

    config = EngineArgs(**engine_kwargs(tiny_model)).create_engine_config()
    assert model_problems(config) == []
    monkeypatch.setattr(type(config.model_config), feature,
                        property(lambda self: True if feature == "is_mm_prefix_lm" else 512))
    assert [p for p in model_problems(config) if reason in p]


def test_unknown_minipic_option_is_refused(tiny_model):
    """A typo would silently leave the default in force."""
    from minipic.config import UnknownOptionError

    with pytest.raises(UnknownOptionError, match="'ssep_tokne_id'.*ssep_token_id"):
        start_llm(tiny_model, additional_config={"minipic": {"ssep_tokne_id": 7}})


@pytest.mark.parametrize("option,value", [("span_attention", "fa3"), ("recipe", "epic3"),
                                          ("mask_markers", "yes"), ("prefill_graphs", "yes"),
                                          ("span_scale", "half"),
                                          ("span_scale", 0), ("span_scale", 1.5),
                                          ("span_scale", True),
                                          ("switch_interval_ms", 0),
                                          ("switch_interval_ms", "fast"),
                                          ("switch_interval_ms", True),
                                          ("switch_interval_ms", 1e-9),
                                          ("switch_interval_ms", float("inf"))])
def test_bad_option_values_are_refused(tiny_model, option, value):
    with pytest.raises(ValueError, match=f"minipic.{option} must be"):
        start_llm(tiny_model, additional_config={"minipic": {option: value}})


def marker_ids(**overrides) -> dict:
    ids = {"ssep_token_id": 3, "pdep_token_id": 4, "pad_token_id": 5, **overrides}
    return {"additional_config": {"minipic": ids}}


@pytest.mark.parametrize("field", ["ssep_token_id", "pdep_token_id", "pad_token_id"])
def test_marker_outside_the_vocabulary_is_refused(tiny_model, field):
    from minipic.marker_checks import MarkerConfigError

    with pytest.raises(MarkerConfigError, match=f"{field}=100000 is outside the model's "
                                                "vocabulary"):
        start_llm(tiny_model, **marker_ids(**{field: 100000}))


@pytest.mark.parametrize("token_id, name", [(1, "BOS"), (2, "EOS")])
def test_bos_or_eos_as_marker_is_refused(tiny_model, token_id, name):
    from minipic.marker_checks import MarkerConfigError

    with pytest.raises(MarkerConfigError, match=f"ssep_token_id={token_id} is the model's {name}"):
        start_llm(tiny_model, **marker_ids(ssep_token_id=token_id))


def connector(**options) -> dict:
    return {"kv_transfer_config": connector_config(options)}


@pytest.mark.parametrize("options, message", [
    ({"cpu_bytes": "abc"}, "cpu_bytes must be a positive size"),
    ({"store_dir": ""}, "store_dir is empty"),
    ({"store_dir": "/tmp/x", "disk_read_threads": "four"}, "disk_read_threads must be a positive"),
    ({"block_size": 64}, "block by block"),
])
def test_bad_connector_options_fail_before_any_engine_process(tiny_model, options, message):
    """Checked as the config is created, in the caller's process: not after the model
    loaded in the engine core and its workers, inside several tracebacks."""
    import multiprocessing
    import time

    from minipic.connector.options import ConnectorConfigError

    started = time.monotonic()
    with pytest.raises(ConnectorConfigError, match=message):
        start_llm(tiny_model, **connector(**options))
    assert multiprocessing.active_children() == []  # no engine core was started
    assert time.monotonic() - started < 30


def test_connector_without_prefix_caching_fails_at_config_creation(tiny_model):
    from vllm.engine.arg_utils import EngineArgs

    from conftest import engine_kwargs
    from minipic.connector.options import ConnectorConfigError

    args = EngineArgs(**engine_kwargs(tiny_model, enable_prefix_caching=False,
                                      **connector(store_dir="/tmp/x")))
    with pytest.raises(ConnectorConfigError, match="prefix caching"):
        args.create_engine_config()


def test_splitting_ops_that_capture_the_kv_cache_write_are_refused_on_cuda(monkeypatch):
    """On CUDA, a graph piece holding the KV cache write would replay the turn of span keys
    into their frames of the batch it was captured with: such splitting_ops are refused."""
    from types import SimpleNamespace

    from vllm.config import CompilationConfig, CompilationMode
    from vllm.platforms import current_platform

    from minipic import support

    def captured(splitting_ops):
        cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, splitting_ops=splitting_ops)
        return support._kv_update_captured(SimpleNamespace(compilation_config=cc))

    assert not captured(["vllm::unified_attention"])  # this machine: CPU
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    assert captured(["vllm::unified_attention"])
    assert not captured(None)  # vLLM's default splitting keeps the write out of graphs
    assert not captured(["vllm::unified_attention", "vllm::unified_kv_cache_update",
                         "vllm::unified_mla_kv_cache_update"])


def test_breakable_cuda_graphs_are_refused_on_cuda(monkeypatch):
    """vLLM's breakable CUDA graphs break at attention only: their segments would replay
    the KV cache write of the batch they were captured with. Refused with graphs on CUDA;
    eager, or on CPU, nothing is captured."""
    from types import SimpleNamespace

    from vllm.config import CompilationConfig, CUDAGraphMode
    from vllm.platforms import current_platform

    from minipic import support

    def refused(mode):
        config = SimpleNamespace(compilation_config=CompilationConfig(cudagraph_mode=mode))
        return support._breakable_graphs_hold_kv_update(config)

    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    assert not refused(CUDAGraphMode.PIECEWISE)  # this machine: CPU
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    assert refused(CUDAGraphMode.PIECEWISE) and refused(CUDAGraphMode.FULL_AND_PIECEWISE)
    assert not refused(CUDAGraphMode.NONE)  # eager
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "0")
    assert not refused(CUDAGraphMode.PIECEWISE)


def test_span_scale_is_refused_where_no_backend_attends_it(monkeypatch):
    """Only the CPU backend weights span keys so far: on a GPU the option would silently
    be 1, so it is refused at start-up there (and accepted at 1)."""
    from types import SimpleNamespace

    from vllm.platforms import current_platform

    from minipic._vllm_patches import _check_span_scale

    def config(value):
        return SimpleNamespace(additional_config={"minipic": {"span_scale": value}})

    _check_span_scale(config(0.5))  # this machine's CPU backend attends it
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    monkeypatch.setattr(type(current_platform), "device_type", "cuda")
    _check_span_scale(config(1))
    with pytest.raises(ValueError, match="span_scale is attended by minipic's CPU backend only"):
        _check_span_scale(config(0.5))
