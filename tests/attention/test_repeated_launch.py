"""segment_kernels.RepeatedLaunch: a launch reuses the last bound one only when Triton would
bind it the same way. Its compiled-kernel path runs on CUDA only (the interpreter compiles
nothing: tests/gpu/test_segment_attention_gpu.py runs it there); here a recording kernel
stands for Triton's, to check when it binds again and where the new tensors go."""

from __future__ import annotations

import pytest
import torch

from minipic.attention.segment_kernels import RepeatedLaunch


class RecordingKernel:
    """kernel[grid](*args, **constexprs) binds (counted) and returns a compiled kernel;
    every launch is recorded as (grid, all parameters in order)."""

    arg_names = ["x", "y", "table", "x_stride", "BLOCK"]

    def __init__(self, compiled: type | None = None) -> None:
        self.binds = 0
        self.launches: list[tuple] = []
        self.compiled = compiled or Compiled

    def __getitem__(self, grid):
        def bound(*args, **constexprs):
            self.binds += 1
            self.launches.append((grid, (*args, *constexprs.values())))
            return self.compiled(self)
        return bound


class Compiled:
    def __init__(self, kernel: RecordingKernel) -> None:
        self.kernel = kernel

    def __getitem__(self, grid):
        gx, gy, gz = grid  # as Triton's compiled launcher reads it: all three sizes
        return lambda *args: self.kernel.launches.append(((gx, gy, gz), args))


def bind(x, y):
    """x twice (as x and as a stand-in for y when y is None), as the turn's keys do."""
    return (x, x if y is None else y, TABLE, x.stride(0)), {"BLOCK": 16}


TABLE = torch.arange(4)


def run(launch: RepeatedLaunch, x, y=None, table=TABLE, grid=(4,), offset=7):
    launch(grid, bind, (x, y), (table, offset))


def test_same_shaped_tensors_reuse_the_binding_in_every_place_they_stand():
    kernel = RecordingKernel()
    launch = RepeatedLaunch(kernel)
    first, second = torch.zeros(4, 8), torch.ones(4, 8)
    run(launch, first)
    run(launch, second)
    assert kernel.binds == 1
    grid, params = kernel.launches[-1]
    assert grid == (4, 1, 1) and params[0] is second and params[1] is second
    assert params[2] is TABLE and params[3:] == (8, 16)  # strides, then constexprs


VARIANTS = {  # name: (the second launch's arguments, whether it binds again)
    "aligned_view": (dict(x=torch.zeros(4 * 8 + 4)[4:].view(4, 8)), False),
    "strides": (dict(x=torch.zeros(8, 4).t()), True),
    "misaligned": (dict(x=torch.zeros(4 * 8 + 1)[1:].view(4, 8)), True),  # 4 bytes off
    "dtype": (dict(x=torch.zeros(4, 8, dtype=torch.float16)), True),
    "shape": (dict(x=torch.zeros(2, 8)), True),
    "tensor_for_none": (dict(x=torch.zeros(4, 8), y=torch.zeros(4, 8)), True),
    "fixed_tensor": (dict(x=torch.zeros(4, 8), table=torch.arange(4)), True),
    # a plain value bind reads (the merge's earlier_offset) is compared by value
    "fixed_int": (dict(x=torch.zeros(4, 8), offset=8), True),
    "fixed_int_equal": (dict(x=torch.zeros(4, 8), offset=int("7")), False),
    "grid": (dict(x=torch.zeros(4, 8), grid=(5,)), True),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_what_the_binding_depends_on_binds_again(name):
    variant, rebinds = VARIANTS[name]
    kernel = RecordingKernel()
    launch = RepeatedLaunch(kernel)
    run(launch, torch.zeros(4, 8))
    run(launch, **variant)
    assert kernel.binds == (2 if rebinds else 1)
    grid, params = kernel.launches[-1]
    assert params[0] is variant["x"] and params[3] == variant["x"].stride(0)



class OldCompiled(Compiled):
    """A launcher of Triton before 3.3: the parameters but the constexprs, and no others."""

    parameters = 4  # RecordingKernel's but its constexpr

    def __getitem__(self, grid):
        def launch(*args):
            assert len(args) == self.parameters, "a real launcher would read garbage, not refuse"
            self.kernel.launches.append((grid, args))
        return launch


@pytest.mark.parametrize("compiled", [Compiled, OldCompiled], ids=["all_parameters", "no_constexprs"])
def test_a_reuse_passes_what_the_tritons_launcher_takes(monkeypatch, compiled):
    from minipic.attention import segment_kernels

    monkeypatch.setattr(segment_kernels, "LAUNCHER_TAKES_CONSTEXPRS", compiled is Compiled)
    kernel = RecordingKernel(compiled)
    launch = RepeatedLaunch(kernel)
    for _ in range(3):
        run(launch, torch.zeros(4, 8))
    assert kernel.binds == 1 and len(kernel.launches) == 3
    reused = [len(params) for _, params in kernel.launches[1:]]
    assert reused == ([5, 5] if compiled is Compiled else [4, 4])


def test_one_tensor_in_two_places_then_two_tensors_binds_again():
    kernel = RecordingKernel()
    launch = RepeatedLaunch(kernel)
    shared, x, y = torch.zeros(4, 8), torch.zeros(4, 8), torch.ones(4, 8)
    run(launch, shared, y=shared)
    run(launch, x, y=y)
    assert kernel.binds == 2
    _, params = kernel.launches[-1]
    assert params[0] is x and params[1] is y


class PositionalConstexprKernel(RecordingKernel):
    """A kernel with a constexpr among its positional parameters (the span kernel's unit
    strides), as Triton lists them (JITFunction.constexprs)."""

    arg_names = ["x", "y", "table", "UNIT", "BLOCK"]
    constexprs = [3, 4]


class OldCompiledOfThree(OldCompiled):
    """Triton before 3.3's launcher of PositionalConstexprKernel: its three others."""

    parameters = 3


@pytest.mark.parametrize("compiled", [Compiled, OldCompiledOfThree],
                         ids=["all_parameters", "no_constexprs"])
def test_a_constexpr_among_the_positional_parameters_is_left_out_for_old_launchers(
        monkeypatch, compiled):
    from minipic.attention import segment_kernels

    monkeypatch.setattr(segment_kernels, "LAUNCHER_TAKES_CONSTEXPRS", compiled is Compiled)
    kernel = PositionalConstexprKernel(compiled)
    launch = RepeatedLaunch(kernel)

    def bind(x, y):  # launch options (num_warps) are no parameters: never passed again
        return (x, y, TABLE, 1), {"BLOCK": 16, "num_warps": 4}

    x, y = torch.zeros(4, 8), torch.ones(4, 8)
    for _ in range(2):
        launch((4,), bind, (x, y), (TABLE,))
    assert kernel.binds == 1 and len(kernel.launches) == 2
    _, params = kernel.launches[-1]
    expected = [x, y, TABLE, 1, 16] if compiled is Compiled else [x, y, TABLE]
    assert len(params) == len(expected)
    assert all(p is e or p == e for p, e in zip(params, expected) if not isinstance(e, torch.Tensor))
    assert all(p is e for p, e in zip(params, expected) if isinstance(e, torch.Tensor))
