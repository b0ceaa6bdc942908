"""One vLLM CPU engine with MiniPICConnector, in its own process, running a plan.

    python engine_child.py PLAN.json OUT.json

PLAN: {"model": ..., "extra_config": {...}, "steps": [...], "log": path} where a step is
  {"op": "generate", "name": str, "prompts": [[ids]...], "max_tokens": int}
  {"op": "touch", "path": str}        signal another process
  {"op": "wait", "path": str}         wait for another process's signal
  {"op": "sleep", "seconds": float}   give something that must not happen time to show
  {"op": "wait_store", "blocks": int}  until the store holds that many block files: background
                                       offloading reached the disk (or 60 s: the test's own
                                       checks then fail)
  {"op": "wait_log", "text": str}      until this run's log has the text (or 60 s)
  {"op": "cli", "args": [...]}        run `minipic ...` (e.g. store evict) while the engine runs
  {"op": "stall_disk_writes"}          block files wait until release (needs "in_process")
  {"op": "idle_check", "name": str}    step the engine as its busy loop would until a held
                                       write waits and it has nothing to step for (or 10 s);
                                       record whether it got there
  {"op": "release_disk_writes"}
PLAN "in_process": true runs the engine core in this process (the ops above patch it).
OUT: {"results": {name: [{"tokens": [...], "cached": int}, ...]}}

Tests start it with subprocess so that each engine is a fresh process: a
restart is a real restart, replicas are real concurrent processes.
"""

from __future__ import annotations

import json
import os
import sys
import time


def make_llm(model: str, extra_config: dict):
    from vllm import LLM

    from minipic.config import connector_config

    return LLM(
        model=model, enforce_eager=True, block_size=32, dtype="float32",
        gpu_memory_utilization=0.1, max_model_len=1024, enable_prefix_caching=True,
        max_num_seqs=8, seed=0,
        kv_transfer_config=connector_config(extra_config),
    )


def generate(llm, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [{"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0}
            for o in outputs]


class StalledWrites:
    """The disk tier's block writes, held until released (an NFS server that hangs)."""

    def __init__(self) -> None:
        import threading

        from minipic.connector.store import block_file

        self.release = threading.Event()
        self.waiting = 0
        original = block_file.write_block

        def write_block(*args, **kwargs):
            self.waiting += 1
            self.release.wait()
            return original(*args, **kwargs)

        block_file.write_block = write_block


def idle_check(llm, stalled: StalledWrites, timeout_s: float = 10.0) -> dict:
    """Step as EngineCoreProc's busy loop does while its scheduler has requests, until a
    held write waits and the scheduler has nothing left (or the timeout)."""
    core = llm.llm_engine.engine_core.engine_core  # InprocClient's EngineCore
    deadline, steps = time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline:
        busy = core.scheduler.has_requests()
        if stalled.waiting and not busy:
            break
        if busy:
            core.step_fn()
            steps += 1
        time.sleep(0.001)
    return {"idle": not core.scheduler.has_requests(), "steps": steps,
            "writes_waiting": stalled.waiting, "released": stalled.release.is_set()}


def wait_for(path: str, timeout_s: float = 600) -> None:
    if not wait_until(lambda: os.path.exists(path), timeout_s):
        raise TimeoutError(f"no signal at {path}")


def store_blocks(store: str) -> int:
    from minipic.connector.store.stats import NotAStore, scan_store

    try:
        return sum(ns.blocks for ns in scan_store(store))
    except (NotAStore, OSError):
        return 0


def wait_until(done, timeout_s: float = 60) -> bool:
    """Polls `done` until it holds (True) or the timeout passes (False)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def log_has(path: str, text: str) -> bool:
    with open(path, errors="replace") as f:
        return text in f.read()


def main(plan_path: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with open(plan_path) as f:
        plan = json.load(f)
    if plan.get("in_process"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    llm = make_llm(plan["model"], plan["extra_config"])
    results: dict[str, list[dict]] = {}
    stalled = None
    for step in plan["steps"]:
        if step["op"] == "generate":
            results[step["name"]] = generate(llm, step["prompts"], step.get("max_tokens", 8))
        elif step["op"] == "touch":
            open(step["path"], "w").close()
        elif step["op"] == "wait":
            wait_for(step["path"])
        elif step["op"] == "sleep":
            time.sleep(step["seconds"])
        elif step["op"] == "wait_store":  # past the timeout, the test's own checks decide
            store = plan["extra_config"]["store_dir"]
            wait_until(lambda: store_blocks(store) >= step["blocks"])
        elif step["op"] == "wait_log":
            wait_until(lambda: log_has(plan["log"], step["text"]))
        elif step["op"] == "cli":
            from minipic.cli import main as minipic_cli

            if minipic_cli(step["args"]) != 0:
                raise RuntimeError(f"minipic {' '.join(step['args'])} failed")
        elif step["op"] == "stall_disk_writes":
            stalled = StalledWrites()
        elif step["op"] == "idle_check":
            results[step["name"]] = idle_check(llm, stalled)
        elif step["op"] == "release_disk_writes":
            stalled.release.set()
    with open(out_path, "w") as f:
        json.dump({"results": results}, f)
    # Shut the engine down: the disk tier finishes its writes (an in-process engine only
    # when told: at exit its write threads would just stop).
    llm.llm_engine.engine_core.shutdown()
    del llm


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
