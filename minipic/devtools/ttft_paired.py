"""tools/bench_ttft.py --paired: stock vLLM and minipic's GPU hit in one process, their timed
prompts taking turns, so that the host's drift over a run (stock's own full prefix hit moved
from 33 to 50 ms within one phase on the H200) and between hosts weighs on both alike.

Both engines share the GPU and are started before anything is timed. Stock keeps one prompt
at a time (STOCK_SHARE of the usual memory share); minipic's engine gets the rest, and must
hold every timed prompt's documents in GPU memory: a hit served from the CPU tier is not a
GPU hit (ttft_phases.check_gpu_holds refuses the run instead). Then for each timed prompt:
stock's recompute of its final prompt, its rerun (stock's own full prefix hit), stock on the
same documents with a new question, and minipic's hit on the same documents. The results are
the two phases' ("stock", "gpu-hit"), tagged `paired`.
"""

from __future__ import annotations

from minipic.devtools.ttft_phases import (Phase, check_gpu_holds, phase_result, start_engine,
                                          time_final, warm_up)

# Stock's part of the usual GPU memory share: on the 8B model (0.85 of an H200) its weights
# and a 40-document prompt's blocks, twice over; the other 0.7 holds minipic's documents.
STOCK_SHARE = 0.3


def run_paired(model: str, engine: dict, connector: dict, load: dict) -> list[dict]:
    share = engine["gpu_memory_utilization"]
    stock_llm, stock = start_engine(
        Phase("stock", "stock", minipic=False), model,
        dict(engine, gpu_memory_utilization=share * STOCK_SHARE), connector)
    hit_llm, hit = start_engine(
        Phase("gpu-hit", "gpu-hit"), model,
        dict(engine, gpu_memory_utilization=share * (1 - STOCK_SHARE)), connector)
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
