"""minipic.devtools.step_phases: functions timed where they are defined, their calls read back
and summed by name inside a window."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from minipic.devtools.step_phases import ENV_FOLDER, TIMED, phases_within, read_phases

MODULE = textwrap.dedent("""
    import time

    class Base:
        def step(self):
            time.sleep(0.002)
            return "stepped"

    class Child(Base):
        pass

    def helper():
        time.sleep(0.002)
        return "helped"
""")

CHILD = textwrap.dedent("""
    import json, time
    from minipic.devtools import step_phases
    step_phases.start_from_env()  # TIMED: whatever this vLLM has
    step_phases._wrap("timed_module:Base.step")
    step_phases._wrap("timed_module:Child.step")  # inherited only: timed once, in Base
    step_phases._wrap("no_such_module:Thing.run")  # not here: skipped
    step_phases._wrap("timed_module:helper")  # a module's function
    import timed_module
    begin = time.monotonic()
    assert timed_module.Child().step() == "stepped"
    assert timed_module.Base().step() == "stepped"
    assert timed_module.helper() == "helped"
    end = time.monotonic()
    step_phases._recorder.flush()
    print(json.dumps([begin, end]))
""")


def test_calls_are_timed_once_where_defined_and_summed_in_a_window(tmp_path):
    (tmp_path / "timed_module.py").write_text(MODULE)
    folder = tmp_path / "phases"
    env = {"PYTHONPATH": f"{tmp_path}:{':'.join(sys.path)}", ENV_FOLDER: str(folder)}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, check=True,
                         capture_output=True, text=True).stdout
    begin, end = __import__("json").loads(out.splitlines()[-1])
    calls = [c for c in read_phases(folder) if c[0] == "Base.step"]
    assert len(calls) == 2 and all(c[2] >= 0.002 for c in calls)
    totals = phases_within(read_phases(folder), begin, end)
    assert totals["Base.step"] >= 0.004 and "Child.step" not in totals
    assert totals["timed_module.helper"] >= 0.002
    assert phases_within(calls, end + 1, end + 2) == {}


def test_a_timed_function_compiles_whole():
    """vLLM compiles the model's forward in one graph (fullgraph), Attention.forward inside:
    a clock read there failed the engine's start (compiled mode, --step-phases)."""
    import torch

    from minipic.devtools import step_phases

    class Layer:
        def forward(self, x):
            return x * 2

    module = type(sys)("compiled_module")
    module.Layer = Layer
    sys.modules["compiled_module"] = module
    try:
        step_phases._wrap("compiled_module:Layer.forward")
        compiled = torch.compile(lambda x: Layer().forward(x) + 1, fullgraph=True,
                                 backend="eager")
        assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 3.0))
    finally:
        del sys.modules["compiled_module"]


def test_the_timed_functions_exist_in_this_vllm():
    """At least the scheduler's and the runner's: a rename would silently time nothing."""
    import importlib

    found = []
    for target in TIMED:
        module, _, attribute = target.partition(":")
        owner, _, name = attribute.rpartition(".")
        try:
            imported = importlib.import_module(module)
            found.append(name in vars(getattr(imported, owner) if owner else imported))
        except Exception:
            found.append(False)
    named = dict(zip(TIMED, found))
    assert named["vllm.v1.core.sched.scheduler:Scheduler.schedule"]
    assert named["vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model"]
    assert sum(found) >= 20
    # minipic's own, on every platform: a renamed function or import would time nothing
    assert [t for t in TIMED if t.startswith("minipic.") and not named[t]] == []
