"""SyncBatchNorm's training path without collectives, the batch_norm_train op: bit for bit the
SyncBatchNormFunction path it replaces at world 1 (outputs, every gradient, running statistics), its
opcheck, torch.compile, and on CUDA the C++ autograd (csrc/syncbn_autograd.cpp)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from apex.parallel import SyncBatchNorm, sync_batchnorm
from apex.parallel.sync_batchnorm import SyncBatchNormFunction

OPS = torch.ops.apex_parallel
PYTHON_NODE = "GeneratedBackwardFor_apex_parallel_batch_norm_train_defaultBackward"


class FunctionPath(SyncBatchNorm):
    """SyncBatchNorm as it was: SyncBatchNormFunction at every world size."""

    def _sync(self, input, z, weight, bias, running, factor, group, world, c_last, relu):
        return SyncBatchNormFunction.apply(
            input, z, weight, bias, running[0], running[1], self.eps, factor, group, world, c_last, relu
        )


def to_layout(t, layout):
    """From (N, C, ...) to what the module takes."""
    if layout == "channels_last_memory":
        return t.contiguous(memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d)
    if layout == "channel_last":
        return t.movedim(1, -1).contiguous()
    return t


LAYOUTS = ["nchw", "channels_last_memory", "channel_last"]


@pytest.fixture(autouse=True)
def _ops_off_cuda(monkeypatch):
    """Off CUDA one process trains through torch's batch norm by default: here through the ops."""
    monkeypatch.setattr(sync_batchnorm, "_TORCH_OFF_CUDA", False)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_training_at_world_1_takes_the_op(layout):
    """SyncBatchNorm's path at world 1 is batch_norm_train (one autograd node), in every layout."""
    x = to_layout(torch.randn(4, 3, 2, 2), layout).requires_grad_()
    node = SyncBatchNorm(3, channel_last=layout == "channel_last")(x).grad_fn
    while type(node).__name__ in ("ViewBackward0", "UnflattenBackward0", "TransposeBackward0"):  # channels_last's view
        node = node.next_functions[0][0]
    assert type(node).__name__ == PYTHON_NODE, type(node).__name__


def modules(channels, layout, device, dtype, affine, track, relu, momentum=0.1):
    g = torch.Generator().manual_seed(11)
    kwargs = dict(momentum=momentum, affine=affine, track_running_stats=track, channel_last=layout == "channel_last")
    new = SyncBatchNorm(channels, fuse_relu=relu, **kwargs)
    if affine:
        with torch.no_grad():
            new.weight.copy_(torch.rand(channels, generator=g) + 0.5)
            new.bias.copy_(torch.randn(channels, generator=g))
    old = FunctionPath(channels, fuse_relu=relu, **kwargs)
    old.load_state_dict(new.state_dict())
    # float32 parameters for 16-bit inputs (the mixed-precision case), the input's dtype otherwise
    param_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return new.to(device, param_dtype), old.to(device, param_dtype)


def step(module, x, z, dy, needs):
    """Two training forwards (one backward) and what they leave; ``needs``: which of input, z, weight
    need a gradient."""
    x = x.clone().requires_grad_(needs["input"])
    z = None if z is None else z.clone().requires_grad_(needs["z"])
    if module.affine:
        module.weight.requires_grad_(needs["weight"])
    out = module(x, z)
    if out.requires_grad:
        out.backward(dy)
    out2 = module(x.detach() * 0.5 - 0.25, None if z is None else z.detach())
    result = {"out": out.detach(), "out2": out2.detach(), "grad_input": x.grad}
    if z is not None:
        result["grad_z"] = z.grad
    result.update({f"grad_{name}": p.grad for name, p in module.named_parameters()})
    result.update(dict(module.named_buffers()))
    return result, out


class OpLog(TorchDispatchMode):
    """The apex_parallel ops called (from Python or C++), each with its non-tensor arguments and
    which optional tensors were given: the paths must run the same kernels, honouring the same
    needs_input_grad."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "apex_parallel":
            given = tuple("tensor" if isinstance(a, torch.Tensor) else a for a in args)
            self.calls.append((func.__name__, given))
        return func(*args, **(kwargs or {}))


FORWARDS = ("batch_norm_forward.default", "batch_norm_forward_c_last.default")


def without_forwards(calls):
    """The calls, batch_norm_train's standing for the forward op it runs (which the mode, running the
    op, does not see)."""
    return [c for c in calls if c[0] not in FORWARDS and c[0] != "batch_norm_train.default"]


def node_names(out, depth=3):
    """The names of ``out``'s autograd nodes up to ``depth`` steps back (views and the unfused add and
    ReLU sit in front of the norm's)."""
    names, frontier = [], [out.grad_fn]
    for _ in range(depth):
        frontier = [n for n in frontier if n is not None]
        names += [n.name() for n in frontier]
        frontier = [nxt for n in frontier for nxt, _ in n.next_functions]
    return names


def assert_same(new, old):
    assert new.keys() == old.keys()
    for key in new:
        a, b = new[key], old[key]
        if b is None:
            assert a is None, f"{key}: expected no gradient"
            continue
        assert a is not None, f"{key}: missing"
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), key
        assert torch.equal(a, b), f"{key}: differs by {(a.double() - b.double()).abs().max().item()}"


NEEDS = {
    "all": dict(input=True, z=True, weight=True),
    "input-only": dict(input=True, z=False, weight=False),
    "no-input": dict(input=False, z=True, weight=True),
    "weight-only": dict(input=False, z=False, weight=True),
}


def run_case(device, layout, dtype, affine, track, relu, with_z, needs, shape=(6, 5, 4, 3), momentum=0.1):
    g = torch.Generator().manual_seed(3)
    x = to_layout((torch.randn(shape, generator=g) * 1.5 + 0.4).to(device, dtype), layout)
    z = to_layout(torch.randn(shape, generator=g).to(device, dtype), layout) if with_z else None
    dy = to_layout(torch.randn(shape, generator=g).to(device, dtype), layout)
    new, old = modules(shape[1], layout, device, dtype, affine, track, relu, momentum)
    with OpLog() as new_log:
        got, out = step(new, x, z, dy, needs)
    with OpLog() as old_log:
        expected, _ = step(old, x, z, dy, needs)
    assert_same(got, expected)
    assert [c[0] for c in new_log.calls].count("batch_norm_train.default") == 2, new_log.calls
    assert sum(c[0] in FORWARDS for c in old_log.calls) == 2, old_log.calls
    assert without_forwards(new_log.calls) == without_forwards(old_log.calls)
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("relu", "with_z"), [(False, False), (True, False), (True, True), (False, True)])
def test_matches_function_path(device, layout, dtype, relu, with_z):
    out = run_case(device, layout, dtype, True, True, relu, with_z, NEEDS["all"])
    assert sync_batchnorm._MASKED_IN_REDUCE
    names = node_names(out)
    assert any("batch_norm_train" in n or "BatchNormTrain" in n for n in names), names


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("affine", "track"), [(False, True), (True, False), (False, False)])
def test_matches_function_path_options(device, layout, affine, track):
    run_case(device, layout, torch.float32, affine, track, True, True, NEEDS["all"])
    run_case(device, layout, torch.float32, affine, track, False, False, NEEDS["all"], momentum=None)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("needs", ["input-only", "no-input", "weight-only"])
@pytest.mark.parametrize("relu", [False, True])
def test_matches_function_path_partial_gradients(device, layout, needs, relu):
    run_case(device, layout, torch.float32, True, True, relu, True, NEEDS[needs])


@pytest.mark.parametrize("shape", [(5, 7), (4, 3, 9), (2, 3, 2, 3, 2)], ids=str)
def test_matches_function_path_other_ranks(device, shape):
    for layout in ("nchw", "channel_last"):
        run_case(device, layout, torch.float32, True, True, True, True, NEEDS["all"], shape=shape)


def test_masked_in_reduce_off_takes_the_function(monkeypatch):
    """The test switch of the other relu kernel keeps SyncBatchNormFunction (the op always masks in
    the reduction)."""
    monkeypatch.setattr(sync_batchnorm, "_MASKED_IN_REDUCE", False)
    out = SyncBatchNorm(3, channel_last=True, fuse_relu=True)(torch.randn(4, 3, requires_grad=True))
    assert type(out.grad_fn).__name__ == "SyncBatchNormFunctionBackward"


def op_args(device, c_last, relu, with_z, affine, dtype=torch.float32):
    g = torch.Generator().manual_seed(5)
    shape = (4, 6, 3) if c_last else (4, 3, 6)
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(device, dtype)
    mean, var = (OPS.welford_mean_var_c_last if c_last else OPS.welford_mean_var)(x)
    count = torch.tensor([24.0], device=device)
    mean, invstd = OPS.welford_parallel(mean[None], var[None], count, 1e-5)
    z = torch.randn(shape, generator=g).to(device, dtype).requires_grad_() if with_z else None
    weight = (torch.rand(3, generator=g) + 0.5).to(device).requires_grad_() if affine else None
    bias = torch.randn(3, generator=g).to(device).requires_grad_() if affine else None
    return (x.requires_grad_(), z, weight, bias, mean, invstd, count, c_last, relu)


OPCHECK_CASES = {
    "c_last-relu-z": (True, True, True, True),
    "c_last-plain": (True, False, False, True),
    "c_last-relu-no-affine": (True, True, False, False),
    "nchw": (False, False, False, True),
    "nchw-no-affine": (False, False, False, False),
}


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_opcheck(device, case):
    torch.library.opcheck(OPS.batch_norm_train.default, op_args(device, *OPCHECK_CASES[case]))


def test_bad_input(device):
    x, z, weight, bias, mean, invstd, count, _, _ = op_args(device, False, False, True, True)
    with pytest.raises(ValueError, match="batch_norm_train: z and relu need c_last=True"):
        OPS.batch_norm_train(x, z, weight, bias, mean, invstd, count, False, False)
    with pytest.raises(ValueError, match="batch_norm_train: z and relu need c_last=True"):
        OPS.batch_norm_train(x, None, weight, bias, mean, invstd, count, False, True)
    with pytest.raises(TypeError, match="batch_norm_train: count has dtype"):
        OPS.batch_norm_train(x, None, weight, bias, mean, invstd, count.long(), False, False)
    with pytest.raises(ValueError, match="batch_norm_train: count must be 1-D"):
        OPS.batch_norm_train(x, None, weight, bias, mean, invstd, count[None], False, False)
    if device == "cuda":  # the rest: the forward ops' own checks in C++, named by those ops
        return
    with pytest.raises(ValueError, match="batch_norm_train: mean has shape"):
        OPS.batch_norm_train(x, None, weight, bias, mean[:2], invstd, count, False, False)
    with pytest.raises(ValueError, match="batch_norm_train: z has shape"):
        xl = x.detach().transpose(1, 2).contiguous()
        OPS.batch_norm_train(xl, z[:, :, :2], None, None, mean, invstd, count, True, True)


@pytest.mark.parametrize("layout", ["channels_last_memory", "channel_last"])
def test_torch_compile_fullgraph_cpu(layout):
    """The op traces whole (its fake, its Python autograd formula) and compiles to eager's values."""
    torch.manual_seed(0)
    shape = (4, 6, 5, 5)
    x = to_layout(torch.randn(shape), layout)
    z = to_layout(torch.randn(shape), layout)
    dy = to_layout(torch.randn(shape), layout)
    eager = SyncBatchNorm(6, fuse_relu=True, channel_last=layout == "channel_last")
    compiled_module = copy.deepcopy(eager)
    targets = []

    def recording(gm, inputs):
        from torch._inductor.compile_fx import compile_fx

        targets.extend(str(node.target) for node in gm.graph.nodes)
        return compile_fx(gm, inputs)

    compiled = torch.compile(compiled_module, fullgraph=True, backend=recording)
    results = []
    for module, fn in ((eager, eager), (compiled_module, compiled)):
        xi, zi = x.clone().requires_grad_(), z.clone().requires_grad_()
        out = fn(xi, zi)
        out.backward(dy)
        results.append((out.detach(), xi.grad, zi.grad, module.weight.grad, module.bias.grad, module.running_var))
    assert "apex_parallel.batch_norm_train.default" in targets, targets
    for a, b in zip(*results):
        torch.testing.assert_close(b, a)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_uses_the_cpp_autograd(layout):
    """On CUDA the op's autograd is the C++ one (csrc/syncbn_autograd.cpp): a missing registration
    would leave the Python formula, with the same values, silently."""
    from apex.core import loader
    from apex.parallel._plugin import KERNELS

    loaded = loader.load(KERNELS)
    assert loaded.has_kernels, loaded.reason
    shape = (4, 6, 5, 5)
    x = to_layout(torch.randn(shape, device="cuda"), layout).requires_grad_()
    module = SyncBatchNorm(6, fuse_relu=layout != "nchw", channel_last=layout == "channel_last").cuda()
    out = module(x)
    names = node_names(out)
    assert any("CppNode" in n and "BatchNormTrain" in n for n in names), names
    assert PYTHON_NODE not in names
    args = op_args("cuda", True, True, True, True)
    name = OPS.batch_norm_train(*args).grad_fn.name()
    assert "CppNode" in name and "BatchNormTrain" in name, name
