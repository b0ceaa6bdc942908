"""minipic.devtools.ttft_phases without an engine: the phases a --disk-phases list makes, and a
workload whose timed prompts each have documents of their own."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from minipic.devtools.bench_setup import TINY_MARKERS, random_words
from minipic.devtools.ttft_phases import (GpuTooSmallError, check_gpu_holds, gpu_blocks_needed,
                                          load_counters, phases_of, with_hit_warmups,
                                          with_new_question, workload)


def test_phases_of_disk_specs():
    phases = phases_of(["warm:4", "cold:16", "warm:16:0"])
    assert [p.name for p in phases] == ["stock", "gpu-hit", "disk-warm-t4", "disk-cold-t16",
                                        "disk-warm-t16-p0"]
    assert [p.prompts for p in phases] == ["stock", "gpu-hit", "disk-0", "disk-1", "disk-2"]
    stock, hit, warm, cold, threads_only = phases
    assert not stock.minipic and hit.minipic and hit.read_threads is None
    assert (warm.read_threads, warm.read_processes, warm.cold) == (4, None, False)
    assert cold.cold and threads_only.read_processes == 0


def test_every_timed_prompt_has_documents_of_its_own():
    doc_counts, repeats, block = [1, 2], 3, 32
    load = workload("tiny", doc_counts, 40, repeats, block, TINY_MARKERS, ["stock", "gpu-hit"])
    ssep = TINY_MARKERS["ssep_token_id"]
    docs_of = lambda final: {tuple(final[i:i + block]) for i in range(0, len(final), block)
                             if final[i] == ssep}
    for name in ("stock", "gpu-hit"):
        finals = load["finals"][name]
        assert [k for k, _ in finals] == [1, 1, 1, 2, 2, 2]
        seen: set = set()
        for k, final in finals:
            docs = docs_of(final)
            assert len(docs) == k and not docs & seen
            seen |= docs
    # The sets share their documents and differ in their questions.
    stock, hit = load["finals"]["stock"], load["finals"]["gpu-hit"]
    assert all(docs_of(a) == docs_of(b) and a != b for (_, a), (_, b) in zip(stock, hit))


def test_stock_gets_the_same_documents_with_a_new_question():
    """Stock's rerun of a prompt computes one token (a decode step); its prompt with a new
    question keeps every block up to the question's (the PDep block) and changes the rest,
    so stock's prefix hit then computes what minipic's hit computes: the question."""
    block, pdep = 32, TINY_MARKERS["pdep_token_id"]
    load = workload("tiny", [1, 2], 40, 2, block, TINY_MARKERS, ["stock", "gpu-hit"])
    assert [k for k, _ in load["new_questions"]] == [k for k, _ in load["finals"]["stock"]]
    for (_, final), (_, asked) in zip(load["finals"]["stock"], load["new_questions"]):
        question = len(final) - 1 - final[::-1].index(pdep)
        assert question % block == 0 and len(asked) == len(final)
        assert asked[: question + 1] == final[: question + 1]
        assert asked[question + 1:] != final[question + 1:]
    assert "new_questions" in workload("tiny", [1], 40, 1, block, TINY_MARKERS, ["gpu-hit"])
    assert with_new_question([1, 4, 2, 4, 5, 6], 4, lambda n: [9] * n) == [1, 4, 2, 4, 9, 9]


def test_stock_warms_up_both_prefix_hits_it_is_timed_on():
    """Stock's first timed rerun and new question must not be the first steps of their kind
    (eager, the first rerun took 150 ms where the second took 52): its warm-up runs each
    warm-up prompt, then that prompt again, then it with a new question."""
    block, pdep = 32, TINY_MARKERS["pdep_token_id"]
    load = workload("tiny", [1, 2], 40, 2, block, TINY_MARKERS, ["stock", "gpu-hit"])
    stock, hit = load["warmups"]["stock"], load["warmups"]["gpu-hit"]
    assert len(stock) == 3 * len(hit)
    for final, rerun, asked in zip(stock[::3], stock[1::3], stock[2::3]):
        question = len(final) - 1 - final[::-1].index(pdep)
        assert rerun == final
        assert asked[: question + 1] == final[: question + 1] and asked != final
    # the timed prompts' new questions are drawn first: the warm-ups leave them as they were
    words = random_words(random.Random(1), "tiny")
    assert load["new_questions"] == [[k, with_new_question(final, pdep, words)]
                                     for k, final in load["finals"]["stock"]]
    assert with_hit_warmups([[1, 4, 5]], 4, lambda n: [9] * n) == [[1, 4, 5], [1, 4, 5],
                                                                    [1, 4, 9]]


def test_load_counters_of_a_store_not_written_yet(tmp_path):
    assert load_counters(str(tmp_path / "store")) == dict.fromkeys(
        ("load_jobs", "load_us", "hit_blocks", "hit_bytes"), 0)


def test_paired_phases_run_stock_and_the_hit_in_one_process():
    phases = phases_of(["warm:4"], paired=True)
    assert [p.name for p in phases] == ["paired", "disk-warm-t4"]
    assert phases[0].paired and phases[0].minipic and phases[0].prompts == "gpu-hit"


def test_a_gpu_hit_phase_whose_cache_cannot_hold_its_documents_is_refused():
    """A paired run's first layout gave the hit engine half the GPU: evicted documents came
    back from the CPU tier and were timed as GPU hits (185 ms for a 50 ms hit)."""
    block = 32
    load = workload("tiny", [1, 2], 40, 2, block, TINY_MARKERS, ["gpu-hit"])
    needed = gpu_blocks_needed(load, block)
    # the system prompt's prefill and 10 documents' (6 timed, 2 for warm-up, 2 for
    # profiling), two blocks each, and the longest final prompt
    longest = max(len(final) for _, final in load["finals"]["gpu-hit"])
    assert needed == 11 * 2 + -(-longest // block)
    engine_with = lambda blocks: SimpleNamespace(llm_engine=SimpleNamespace(
        vllm_config=SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=blocks))))
    check_gpu_holds(engine_with(needed), load, block)
    with pytest.raises(GpuTooSmallError, match=f"holds {needed - 1} blocks .* need {needed}"):
        check_gpu_holds(engine_with(needed - 1), load, block)


def test_paired_stock_kv_holds_one_max_length_request_and_its_prompt(tmp_path):
    """A fixed 0.3 of the share left stock 3.24 GiB of KV on an 80 GB card, less than one
    max_model_len request of the 8B model (4 GiB at 32768 tokens): vLLM refused the start."""
    from minipic.devtools import llama3_8b
    from minipic.devtools.bench_setup import make_model
    from minipic.devtools.ttft_paired import stock_kv_bytes

    model, engine, markers = make_model("llama3-8b", tmp_path)
    load = workload("llama3-8b", [10], 1000, 1, engine["block_size"], markers, ["stock"])
    longest = max(len(final) for _, final in load["finals"]["stock"])
    config = llama3_8b.CONFIG
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * 128 * 2
    tokens = stock_kv_bytes(model, engine, load) / per_token
    assert tokens % engine["block_size"] == 0
    assert engine["max_model_len"] <= tokens < engine["max_model_len"] + engine["block_size"]
    assert tokens >= longest + 2 * engine["block_size"]  # the prompt, its rerun's new blocks
    assert tokens * per_token / 2**30 <= 4  # GiB: weights and this fit beside minipic's share
    with pytest.raises(ValueError, match="leaves stock no room"):
        stock_kv_bytes(model, dict(engine, max_model_len=longest), load)


def test_paired_hit_engine_gets_the_share_stock_leaves():
    from minipic.devtools.ttft_paired import hit_share

    assert hit_share(0.85, 0.25) == pytest.approx(0.60)
    with pytest.raises(RuntimeError, match="already takes 0.90 of the GPU.*share of 0.85"):
        hit_share(0.85, 0.90)


def test_paired_reads_the_memory_of_the_gpu_the_engines_run_on(monkeypatch):
    """NVML numbers GPUs physically; with CUDA_VISIBLE_DEVICES=3 the engines' GPU is 3."""
    import sys

    import vllm.third_party
    from vllm.platforms import current_platform

    from minipic.devtools.ttft_paired import gpu_used_fraction

    handles = []
    fake = SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda index: handles.append(index) or index,
        nvmlDeviceGetMemoryInfo=lambda handle: SimpleNamespace(used=20, total=80))
    monkeypatch.setitem(sys.modules, "vllm.third_party.pynvml", fake)
    monkeypatch.setattr(vllm.third_party, "pynvml", fake, raising=False)
    monkeypatch.setattr(type(current_platform), "visible_device_id_to_physical_device_id",
                        classmethod(lambda cls, index: 3))
    assert gpu_used_fraction() == 0.25 and handles == [3]
