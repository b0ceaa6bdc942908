"""tools/bench_ttft.py --paired: stock vLLM and minipic's GPU hit in one process, their timed
prompts taking turns, so that the host's drift over a run (stock's own full prefix hit moved
from 33 to 50 ms within one phase on the H200) and between hosts weighs on both alike.

Both engines share the GPU and are started before anything is timed. Stock's KV cache is
sized to what it keeps (one prompt at a time, see stock_kv_bytes); minipic's engine gets the
rest of the usual memory share, and must hold every timed prompt's documents in GPU memory: a
hit served from the CPU tier is not a GPU hit (ttft_phases.check_gpu_holds refuses the run
instead). Then for each timed prompt:
stock's recompute of its final prompt, its rerun (stock's own full prefix hit), stock on the
same documents with a new question, and minipic's hit on the same documents. The results are
the two phases' ("stock", "gpu-hit"), tagged `paired`.
"""

from __future__ import annotations

from minipic.devtools.bench_setup import kv_bytes_per_token
from minipic.devtools.ttft_phases import (Phase, check_gpu_holds, phase_result, start_engine,
                                          time_final, warm_up)

# Stock's memory request at start-up (vLLM refuses a start whose share exceeds the free
# memory); with kv_cache_memory_bytes given, its KV cache does not follow this share.
STOCK_REQUEST = 0.25


def run_paired(model: str, engine: dict, connector: dict, load: dict) -> list[dict]:
    share = engine["gpu_memory_utilization"]
    stock_llm, stock = start_engine(
        Phase("stock", "stock", minipic=False), model,
        dict(engine, gpu_memory_utilization=share * STOCK_REQUEST,
             kv_cache_memory_bytes=stock_kv_bytes(model, engine, load)), connector)
    hit_llm, hit = start_engine(
        Phase("gpu-hit", "gpu-hit"), model,
        dict(engine, gpu_memory_utilization=hit_share(share, gpu_used_fraction())), connector)
    check_gpu_holds(hit_llm, load, engine["block_size"])
    warm_up(hit, load, "gpu-hit", connector)
    warm_up(stock, load, "stock", connector)
    stock_points: dict[int, dict] = {}
    hit_points: dict[int, dict] = {}
    for (docs, stock_final), (_, hit_final), (_, new_question) in zip(
            load["finals"]["stock"], load["finals"]["gpu-hit"], load["new_questions"]):
        time_final(stock_points, "stock", stock, docs, stock_final, rerun=True,
                   new_question=new_question)
        time_final(hit_points, "gpu-hit", hit, docs, hit_final, rerun=False)
    stock_llm.llm_engine.engine_core.shutdown()
    hit_llm.llm_engine.engine_core.shutdown()  # the disk tier finishes its writes
    return [phase_result("stock", stock_points, paired=True),
            phase_result("gpu-hit", hit_points, paired=True)]


def stock_kv_bytes(model: str, engine: dict, load: dict) -> int:
    """Stock's KV cache: max_model_len tokens, vLLM's minimum. Stock keeps one prompt at a
    time, and max_model_len holds its longest prompt with room to spare for the blocks its
    rerun and new question add (measure() sizes it with 64 tokens and the links' allowance
    over it). A fixed share of an 80 GB card left stock less than this; every byte more
    is taken from the documents minipic's engine must hold."""
    block_size = engine["block_size"]
    longest = max(len(final) for _, final in load["finals"]["stock"])
    tokens = -(-engine["max_model_len"] // block_size) * block_size
    if tokens < longest + 2 * block_size:
        raise ValueError(f"--paired: max_model_len {engine['max_model_len']} leaves stock no "
                         f"room beside its {longest}-token prompt")
    return tokens * kv_bytes_per_token(model, engine["dtype"])


def hit_share(share: float, used: float) -> float:
    """minipic's engine's memory share: the usual share less what is in use (stock's
    engine), as vLLM's start-up check counts it against the free memory."""
    if used >= share:
        raise RuntimeError(
            f"--paired: stock's engine already takes {used:.2f} of the GPU, the whole usual "
            f"share of {share:.2f}; minipic's engine has no room (time fewer --docs)")
    return share - used


def gpu_used_fraction() -> float:
    """The GPU memory in use (stock's engine, started first), as a fraction of the card the
    engines run on (the first visible one). NVML, not torch: a CUDA context in this process
    would make vLLM spawn instead of fork its next engine."""
    from vllm.platforms import current_platform
    from vllm.third_party import pynvml

    pynvml.nvmlInit()
    try:
        index = current_platform.visible_device_id_to_physical_device_id(0)
        info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
        return info.used / info.total
    finally:
        pynvml.nvmlShutdown()
