"""Unsampled wall time of vLLM's and minipic's main host functions, in every vLLM process.

A stack sampler (stack_sampler.py) takes the GIL every millisecond and slows what it
watches (a 40-document hit sampled: 91 ms, unsampled 54); cProfile sees one thread. With
`MINIPIC_STEP_PHASES=<folder>` set, minipic's plugin entry point wraps the functions in
TIMED (those this vLLM has) with two clock reads each, in each process vLLM starts (forked
engine cores included), and appends `[name, start, seconds]` (time.monotonic(): one clock
for every process of the host) to `<folder>/<pid>.phases.jsonl`, flushed at the end of each
step's last function (FLUSH_AFTER: a request's records are on disk once it has returned),
every FLUSH_RECORDS records and at exit. Times are inclusive (schedule() holds the connector's
lookups); a function vLLM runs once a layer is recorded once a layer. `phases_within` sums
them by name inside a request's [begin, end] (tools/bench_ttft.py --step-phases). In
compiled mode a function torch.compile traces (Attention.forward) is not recorded.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import inspect
import json
import logging
import os
import threading
import time
from pathlib import Path

import torch

from minipic.devtools.process_logs import read_records, this_process_log

logger = logging.getLogger(__name__)

ENV_FOLDER = "MINIPIC_STEP_PHASES"
SUFFIX = ".phases.jsonl"
FLUSH_RECORDS = 512
FLUSH_AFTER = frozenset({"Scheduler.update_from_output", "OutputProcessor.process_outputs"})

# "module:Class.method" or "module:function" (the name as that module calls it: a function
# imported by name is timed in the module that imported it), by the process that runs it;
# versions without one skip it.
TIMED = (
    # front end
    "vllm.v1.engine.input_processor:InputProcessor.process_inputs",
    "minipic.protocol:SpanProtocol.check_marker_placement",
    "vllm.v1.engine.output_processor:OutputProcessor.process_outputs",
    # engine core: its input thread, then the scheduler
    "vllm.v1.engine.core:EngineCore.preprocess_add_request",
    "vllm.v1.engine.core:EngineCore.step",
    "vllm.v1.engine.core:EngineCore.step_with_batch_queue",
    "vllm.v1.core.sched.scheduler:Scheduler.add_request",
    "vllm.v1.core.sched.scheduler:Scheduler.schedule",
    "vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
    "vllm.v1.core.kv_cache_manager:KVCacheManager.get_computed_blocks",
    "vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots",
    "minipic.connector.connector:MiniPICConnector.on_new_request",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector:"
    "OffloadingConnector.get_num_new_matched_tokens",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector:"
    "OffloadingConnector.build_connector_meta",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector:"
    "OffloadingConnector.update_connector_output",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector:"
    "OffloadingConnector.request_finished",
    # worker: the offloading connector's side of a step
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector:"
    "OffloadingConnector.start_load_kv",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector:"
    "OffloadingConnector.wait_for_save",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector:"
    "OffloadingConnector.get_finished",
    # worker: Model Runner V2 (vLLM 0.25 on CUDA)
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner.add_requests",
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner.prepare_inputs",
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner.prepare_attn",
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner.execute_model",
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner.sample_tokens",
    "vllm.v1.worker.gpu.model_states.default:DefaultModelState.prepare_attn",
    "vllm.v1.worker.gpu.kv_connector:ActiveKVConnector.pre_forward",
    "vllm.v1.worker.gpu.kv_connector:ActiveKVConnector.post_forward",
    "minipic._vllm_patches:_note_host_prompts",  # minipic's part of add_requests
    # worker: the model's run, its piecewise CUDA graphs one replay a piece (checked on
    # vLLM 0.25.1; absent names are skipped)
    "vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager.run_pw_graph",
    "vllm.compilation.cuda_graph:CUDAGraphWrapper.__call__",
    # worker: the V1 runner (vLLM 0.32 on CPU)
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._build_attention_metadata",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._model_forward",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens",
    # attention: metadata once a step, the layers' calls once a layer
    "vllm.v1.attention.backends.flash_attn:FlashAttentionMetadataBuilder.build",
    "minipic.attention.cuda_backend:SpanBatchBuilder._add_spans",
    "minipic.attention.cuda_backend:current_layout",
    "minipic.attention.cuda_backend:segment_plan",
    "minipic.attention.cuda_backend:prepare",
    "minipic.attention.cuda_backend:key_turn_backs",
    "vllm.model_executor.layers.attention.attention:Attention.forward",
    "minipic.attention.cuda_backend:SpanBatchImpl.forward",
    "minipic.attention.cuda_backend:SpanBatchImpl.do_kv_cache_update",
    "vllm.v1.attention.backends.flash_attn:FlashAttentionImpl.do_kv_cache_update",
    # minipic's rows path a layer: the turn, the FlashAttention calls, the merge (the
    # kernels' wrappers are timed in their module: segment_attention imports them at call
    # time, and a module-level import there would keep the untimed ones)
    "minipic.attention.segment_kernels:turn_rows_and_keys",
    "minipic.attention.cuda_backend:vllm_flash_rows",
    "minipic.attention.segment_kernels:merge_rows",
    "vllm.v1.attention.backends.flash_attn:FlashAttentionImpl.forward",
)

_started = False
_recorder: "_Recorder | None" = None  # this process's (a forked child opens its own)


class _Recorder:
    def __init__(self, path: Path) -> None:
        self._path = path
        self._records: list = []
        self._lock = threading.Lock()

    def add(self, name: str, start: float, seconds: float) -> None:
        with self._lock:  # the input thread and the main loop both record
            self._records.append([name, start, seconds])
            full = len(self._records) >= FLUSH_RECORDS
        if full or name in FLUSH_AFTER:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            records, self._records = self._records, []
        if records:
            with open(self._path, "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in records))


def start_from_env() -> None:
    """Wrap TIMED in this process if MINIPIC_STEP_PHASES names a folder (once); a process
    forked from it records into a file of its own."""
    global _started
    if not os.environ.get(ENV_FOLDER) or _started:
        return
    _started = True
    _open_recorder()
    os.register_at_fork(after_in_child=_open_recorder)
    atexit.register(lambda: _recorder and _recorder.flush())
    for target in TIMED:
        _wrap(target)


def _open_recorder() -> None:
    global _recorder
    path = this_process_log(ENV_FOLDER, SUFFIX)
    _recorder = None if path is None else _Recorder(path)


def _wrap(target: str) -> None:
    module_name, _, attribute = target.partition(":")
    owner_name, _, method_name = attribute.rpartition(".")
    try:
        module = importlib.import_module(module_name)
        owner = getattr(module, owner_name) if owner_name else module
    except Exception as e:  # not in this vLLM (or this platform): nothing to time
        logger.debug("minipic step phases: no %s (%s)", target, e)
        return
    original = vars(owner).get(method_name)
    if not inspect.isfunction(original):
        return  # inherited only (timed where it is defined), or a static or class method
    # a module's function by where it is defined: "segment_attention.prepare"
    name = attribute if owner_name else f"{original.__module__.rpartition('.')[2]}.{attribute}"

    @functools.wraps(original)
    def timed(*args, **kwargs):
        # Inside a graph torch.compile traces (the model's layers, vLLM's default mode) a
        # clock read fails the engine's start, and a replayed graph would time nothing.
        if torch.compiler.is_compiling():
            return original(*args, **kwargs)
        start = time.monotonic()
        try:
            return original(*args, **kwargs)
        finally:
            if _recorder is not None:
                _recorder.add(name, start, time.monotonic() - start)

    setattr(owner, method_name, timed)


def read_phases(folder: Path) -> list[tuple[str, float, float]]:
    """Every recorded call of every process."""
    return read_records(folder, SUFFIX)


def phases_within(calls: list[tuple], begin: float, end: float) -> dict[str, float]:
    """Seconds by function name of the calls that started inside [begin, end]."""
    return {name: seconds for name, (seconds, _) in calls_within(calls, begin, end).items()}


def calls_within(calls: list[tuple], begin: float, end: float) -> dict[str, tuple[float, int]]:
    """(seconds, calls) by function name of the calls that started inside [begin, end]."""
    totals: dict[str, tuple[float, int]] = {}
    for name, start, seconds in calls:
        if begin <= start <= end:
            total, count = totals.get(name, (0.0, 0))
            totals[name] = (total + seconds, count + 1)
    return totals
