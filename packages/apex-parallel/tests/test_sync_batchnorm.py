"""apex.parallel.SyncBatchNorm against torch batch norm over the concatenated batch: one process, and
real process groups (gloo on the CPU with 2, 3 and 4 ranks; NCCL on two GPUs)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed as dist

from apex.core.testing import graph_reaches, run_ranks
from apex.parallel import (
    SyncBatchNorm,
    convert_syncbn_model,
    create_syncbn_process_group,
    optimized_sync_batchnorm,
    sync_batchnorm,
)

TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float64: 1e-10}
TORCH_BN = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d, 5: torch.nn.BatchNorm3d}


def close(actual, expected, dtype, what=""):
    tol = TOL[dtype]
    expected = expected.double().cpu()
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(
        actual.double().cpu(), expected, rtol=tol, atol=tol * (scale + 1.0), msg=lambda m: f"{what}: {m}"
    )


# A case: the per-channel data of the whole batch (shape with C at dim 1, N = sum of batches),
# how the module sees it (layout), and its options.
def case_data(case):
    g = torch.Generator().manual_seed(case["seed"])
    shape = (sum(case["batches"]), *case["shape"])
    x = torch.randn(shape, generator=g) * 1.5 + 0.4
    x2 = torch.randn(shape, generator=g) * 0.5 - 1.0
    dy = torch.randn(shape, generator=g)
    z = torch.randn(shape, generator=g) if case.get("relu") else None
    c = shape[1]
    weight = torch.rand(c, generator=g) + 0.5
    bias = torch.randn(c, generator=g)
    return x, x2, dy, z, weight, bias


def to_layout(t, layout):
    """From (N, C, ...) to what the module takes."""
    if t is None:
        return None
    if layout == "channels_last_memory":
        return t.contiguous(memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d)
    if layout == "channel_last":
        return t.movedim(1, -1).contiguous()
    return t


def from_layout(t, layout):
    return t.movedim(-1, 1) if layout == "channel_last" else t


def run_module(module, case, slices, device, dtype):
    """Train step 1 (forward + backward), train step 2 (forward), eval forward; results on the CPU."""
    layout = case["layout"]
    x, x2, dy, z = (None if t is None else t[slices] for t in slices_of(case))
    x = to_layout(x.to(device, dtype), layout).requires_grad_()
    zz = None if z is None else to_layout(z.to(device, dtype), layout).requires_grad_()
    out = module(x, zz) if zz is not None else module(x)
    out.backward(to_layout(dy.to(device, dtype), layout))
    module(to_layout(x2.to(device, dtype), layout))
    module.eval()
    with torch.no_grad():
        eval_out = module(to_layout(x2.to(device, dtype), layout), None if zz is None else zz.detach())
    module.train()
    result = {
        "out": from_layout(out.detach(), layout),
        "grad_input": from_layout(x.grad, layout),
        "eval_out": from_layout(eval_out, layout),
        **parameter_results(module),
    }
    if zz is not None:
        result["grad_z"] = from_layout(zz.grad, layout)
    # numpy arrays pickle by value (tensors would travel as shared-memory handles).
    return {k: v.detach().double().cpu().numpy() for k, v in result.items()}


def parameter_results(bn):
    """The weight gradients and running statistics of ``bn``, a SyncBatchNorm or a torch batch norm."""
    result = {}
    if bn.affine:
        result.update(grad_weight=bn.weight.grad, grad_bias=bn.bias.grad)
    if bn.track_running_stats:
        result.update(
            running_mean=bn.running_mean, running_var=bn.running_var, num_batches_tracked=bn.num_batches_tracked
        )
    return result


def slices_of(case):
    x, x2, dy, z, _, _ = case_data(case)
    return x, x2, dy, z


def make_module(case, device, dtype, process_group=None):
    c = case["shape"][0]
    _, _, _, _, weight, bias = case_data(case)
    module = SyncBatchNorm(
        c,
        eps=case.get("eps", 1e-5),
        momentum=case.get("momentum", 0.1),
        affine=case.get("affine", True),
        track_running_stats=case.get("track", True),
        process_group=process_group,
        channel_last=case["layout"] == "channel_last",
        fuse_relu=case.get("relu", False),
    ).to(device=device, dtype=torch.float64 if dtype == torch.float64 else None)  # a float64 model is float64
    if module.affine:
        with torch.no_grad():
            module.weight.copy_(weight)
            module.bias.copy_(bias)
    return module


def reference(case, rows, relu_mask=None):
    """torch batch norm (float64) over the rows ``rows`` of the whole batch: the same three steps.

    ``relu_mask``: with a fused ReLU, where the gradient passes (the module's own output > 0).
    A pre-activation within rounding of zero may land on either side in fp16/bf16, flipping
    that element's gradient between dy and 0; the backward is checked against the mask the
    forward actually applied (the forward values themselves are compared as usual).
    """
    x, x2, dy, z, weight, bias = case_data(case)
    x, x2, dy = x[rows].double(), x2[rows].double(), dy[rows].double()
    z = None if z is None else z[rows].double().requires_grad_()
    dim = x.dim()
    bn = TORCH_BN[dim](
        x.shape[1],
        eps=case.get("eps", 1e-5),
        momentum=case.get("momentum", 0.1),
        affine=case.get("affine", True),
        track_running_stats=case.get("track", True),
    ).double()
    if bn.affine:
        with torch.no_grad():
            bn.weight.copy_(weight)
            bn.bias.copy_(bias)
    relu = case.get("relu", False)

    def apply(t, zz):
        y = bn(t)
        if zz is not None:
            y = y + zz
        return torch.relu(y) if relu else y

    x = x.requires_grad_()
    if relu and relu_mask is not None:
        relu = False
        pre = apply(x, z)
        relu = True
        out = torch.relu(pre)
        pre.backward(dy * relu_mask.to(dy.dtype))
    else:
        out = apply(x, z)
        out.backward(dy)
    apply(x2, z)
    bn.eval()
    with torch.no_grad():
        eval_out = apply(x2, z)
    result = {"out": out.detach(), "grad_input": x.grad, "eval_out": eval_out, **parameter_results(bn)}
    if z is not None:
        result["grad_z"] = z.grad
    return result


def rank_rows(case, rank):
    start = sum(case["batches"][:rank])
    return slice(start, start + case["batches"][rank])


def check_ranks(case, results, dtype, group_size=None):
    """Compares each rank's results with the reference over its group's rows."""
    world = len(results)
    group_size = group_size or world
    for first in range(0, world, group_size):
        members = range(first, first + group_size)
        lo = sum(case["batches"][:first])
        hi = lo + sum(case["batches"][r] for r in members)
        mask = None
        if case.get("relu", False):
            mask = torch.cat([torch.from_numpy(results[r]["out"]) > 0 for r in members])
        expected = reference(case, slice(lo, hi), relu_mask=mask)
        for r in members:
            got = {k: torch.from_numpy(v) for k, v in results[r].items()}
            offset = sum(case["batches"][first:r])
            rows = slice(offset, offset + case["batches"][r])
            name = f"{case['name']} rank {r}"
            for key in ("out", "grad_input", "grad_z"):
                if key in expected:
                    close(got[key], expected[key][rows], dtype, f"{name} {key}")
            # eval uses the running statistics (the same on every rank of the group), or without
            # them this rank's own batch, unsynchronized, as torch.nn.SyncBatchNorm.
            if case.get("track", True):
                close(got["eval_out"], expected["eval_out"][rows], dtype, f"{name} eval_out")
            else:
                own = reference(case, rank_rows(case, r))["eval_out"]
                close(got["eval_out"], own, dtype, f"{name} eval_out")
            for key in ("running_mean", "running_var", "num_batches_tracked"):
                if key in expected:
                    low = dtype in (torch.float16, torch.bfloat16)
                    close(got[key], expected[key], torch.float16 if low else dtype, key)
        for key in ("grad_weight", "grad_bias"):
            if key in expected:
                # Weight gradients stay local (DDP averages them): their sum over the group is the whole's.
                total = sum(torch.from_numpy(results[r][key]).double() for r in members)
                close(total, expected[key], dtype, f"{case['name']} {key}")


def cpu_cases():
    cases = []
    for layout in ("nchw", "channels_last_memory", "channel_last"):
        cases.append(dict(name=f"4d-{layout}", shape=(5, 4, 3), layout=layout))
    cases += [
        dict(name="2d", shape=(6,), layout="nchw"),
        dict(name="3d", shape=(3, 7), layout="nchw"),
        dict(name="5d-channels-last", shape=(3, 2, 3, 2), layout="channels_last_memory"),
        dict(name="5d-channel-last", shape=(3, 2, 2, 3), layout="channel_last"),
        dict(name="momentum-none", shape=(4, 3, 3), layout="nchw", momentum=None),
        dict(name="relu-z-channel-last", shape=(5, 3, 3), layout="channel_last", relu=True),
        dict(name="relu-z-channels-last-memory", shape=(5, 3, 3), layout="channels_last_memory", relu=True),
        dict(name="relu-z-nchw", shape=(5, 3, 3), layout="nchw", relu=True),
        dict(name="no-affine-no-running", shape=(3, 4, 4), layout="nchw", affine=False, track=False),
    ]
    return cases


def with_batches(cases, batches):
    return [dict(case, seed=i, batches=list(batches[i % len(batches)])) for i, case in enumerate(cases)]


# Workers (run in each rank's process) ------------------------------------------------------------


def worker_cases(rank, world, cases, backend, dtype_name, group_size):
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    dtype = getattr(torch, dtype_name)
    group = create_syncbn_process_group(group_size) if group_size else None
    results = []
    for case in cases:
        module = make_module(case, device, dtype, process_group=group)
        results.append(run_module(module, case, rank_rows(case, rank), device, dtype))
    return results


def worker_process_groups(rank, world):
    """create_syncbn_process_group's contract and bad sizes."""
    errors = []
    for size in (3, 8):
        try:
            create_syncbn_process_group(size)
        except ValueError as e:
            errors.append(str(e))
    group = create_syncbn_process_group(2)
    assert create_syncbn_process_group(0) is None
    members = torch.zeros(world)
    members[rank] = 1.0
    dist.all_reduce(members, group=group)
    return errors, members.tolist()


# Multi-process tests -----------------------------------------------------------------------------


def test_two_ranks_gloo():
    cases = with_batches(cpu_cases(), [(3, 2), (1, 4), (2, 2), (4, 1)])
    results = run_ranks(__file__, "worker_cases", 2, args=(cases, "gloo", "float32", 0), timeout=240)
    for i, case in enumerate(cases):
        check_ranks(case, [results[r][i] for r in range(2)], torch.float32)


def test_two_ranks_gloo_float64():
    """float64 input, weights and buffers (as upstream's Python SyncBatchNorm takes them), to float64 accuracy."""
    cases = [
        dict(name="f64-nchw", shape=(4, 3), layout="nchw"),
        dict(name="f64-channels-last", shape=(3, 2, 3), layout="channels_last_memory"),
        dict(name="f64-relu-z-channel-last", shape=(3, 3, 2), layout="channel_last", relu=True, momentum=None),
    ]
    cases = with_batches(cases, [(3, 2), (1, 4)])
    results = run_ranks(__file__, "worker_cases", 2, args=(cases, "gloo", "float64", 0), timeout=240)
    for i, case in enumerate(cases):
        check_ranks(case, [results[r][i] for r in range(2)], torch.float64)


def test_three_ranks_gloo_uneven_and_empty():
    cases = [
        dict(name="4d-nchw", shape=(3, 2, 5), layout="nchw"),
        dict(name="4d-channel-last-relu", shape=(3, 3, 4), layout="channel_last", relu=True, momentum=None),
        dict(name="2d", shape=(5,), layout="nchw"),
    ]
    cases = with_batches(cases, [(2, 0, 3), (1, 2, 4), (3, 1, 1)])
    results = run_ranks(__file__, "worker_cases", 3, args=(cases, "gloo", "float32", 0), timeout=240)
    for i, case in enumerate(cases):
        check_ranks(case, [results[r][i] for r in range(3)], torch.float32)


def test_four_ranks_subgroups_gloo():
    cases = with_batches(
        [
            dict(name="groups-nchw", shape=(3, 3, 3), layout="nchw"),
            dict(name="groups-channels-last", shape=(4, 2, 3), layout="channels_last_memory"),
        ],
        [(2, 3, 1, 2)],
    )
    results = run_ranks(__file__, "worker_cases", 4, args=(cases, "gloo", "float32", 2), timeout=240)
    for i, case in enumerate(cases):
        check_ranks(case, [results[r][i] for r in range(4)], torch.float32, group_size=2)
    groups = run_ranks(__file__, "worker_process_groups", 4, timeout=240)
    for rank, (errors, members) in enumerate(groups):
        assert len(errors) == 2 and all("is not divisible by" in e for e in errors)
        first = rank // 2 * 2
        assert members == [1.0 if first <= r < first + 2 else 0.0 for r in range(4)]


@pytest.mark.multigpu
def test_two_gpus_nccl():
    layouts = ("nchw", "channels_last_memory", "channel_last")
    cases = [dict(name=f"gpu-{layout}", shape=(8, 7, 7), layout=layout) for layout in layouts]
    cases += [
        dict(name="gpu-relu-z", shape=(16, 5, 5), layout="channel_last", relu=True),
        dict(name="gpu-2d", shape=(33,), layout="nchw"),
        dict(name="gpu-5d", shape=(4, 3, 5, 2), layout="channels_last_memory", momentum=None),
        dict(name="gpu-resnet-like", shape=(64, 14, 14), layout="channels_last_memory"),
    ]
    cases = with_batches(cases, [(4, 3), (2, 6), (5, 5)])
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        results = run_ranks(
            __file__, "worker_cases", 2, backend="nccl", args=(cases, "nccl", str(dtype)[6:], 0), timeout=300
        )
        for i, case in enumerate(cases):
            check_ranks(case, [results[r][i] for r in range(2)], dtype)


# One process -----------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _ops_off_cuda(monkeypatch):
    """One process off CUDA trains through torch's batch norm by default (sync_batchnorm._TORCH_OFF_CUDA);
    the tests of this file run the ops' references there, as the CUDA kernels and several ranks do.
    The tests taking ``cpu_path`` also run the default."""
    monkeypatch.setattr(sync_batchnorm, "_TORCH_OFF_CUDA", False)


CPU_PATHS = pytest.mark.parametrize("cpu_path", ["ops", "torch"])


def use_cpu_path(cpu_path, device, monkeypatch):
    if cpu_path == "torch":
        if device != "cpu":
            pytest.skip("torch's batch norm is the default off CUDA only")
        monkeypatch.setattr(sync_batchnorm, "_TORCH_OFF_CUDA", True)


@pytest.mark.parametrize(
    "case",
    [
        dict(name="nchw", shape=(4, 3, 5), layout="nchw"),
        dict(name="channels-last", shape=(4, 3, 5), layout="channels_last_memory"),
        dict(name="channel-last-relu", shape=(4, 3, 5), layout="channel_last", relu=True),
        dict(name="2d-momentum-none", shape=(7,), layout="nchw", momentum=None),
        dict(name="5d", shape=(2, 3, 2, 3), layout="nchw"),
    ],
    ids=lambda c: c["name"],
)
@CPU_PATHS
def test_single_process_matches_torch(device, case, cpu_path, monkeypatch):
    """Without a process group: the local batch, as torch batch norm."""
    use_cpu_path(cpu_path, device, monkeypatch)
    case = dict(case, seed=1, batches=[5])
    module = make_module(case, device, torch.float32)
    got = run_module(module, case, slice(0, 5), device, torch.float32)
    check_ranks(case, [got], torch.float32)


@pytest.mark.parametrize("layout", ["nchw", "channels_last_memory", "channel_last"])
@CPU_PATHS
def test_single_process_float64(device, layout, cpu_path, monkeypatch):
    use_cpu_path(cpu_path, device, monkeypatch)
    case = dict(name=f"f64-{layout}", shape=(4, 3, 5), layout=layout, seed=5, batches=[6], relu=True)
    module = make_module(case, device, torch.float64)
    got = run_module(module, case, slice(0, 6), device, torch.float64)
    check_ranks(case, [got], torch.float64)


@pytest.mark.parametrize("with_z", [False, True], ids=["no-z", "z"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["nchw", "channels_last_memory", "channel_last"])
def test_one_process_off_cuda_is_torchs_batch_norm(layout, dtype, with_z, monkeypatch):
    """The default off CUDA: F.batch_norm (16-bit input with float32 parameters too), then z and the
    ReLU; its autograd is torch's; results as nn.BatchNorm2d + z + ReLU over the same input. A 16-bit
    input with z takes the ops (one rounding of the sum, as the kernels)."""
    monkeypatch.setattr(sync_batchnorm, "_TORCH_OFF_CUDA", True)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 5, 4, 3, generator=g) * 2 + 1).to(dtype)
    z = torch.randn(6, 5, 4, 3, generator=g).to(dtype)
    dy = torch.randn(6, 5, 4, 3, generator=g).to(dtype)
    ours = SyncBatchNorm(5, fuse_relu=True, channel_last=layout == "channel_last")
    with torch.no_grad():
        ours.weight.copy_(torch.rand(5, generator=g) + 0.5)
        ours.bias.copy_(torch.randn(5, generator=g))
    theirs = torch.nn.BatchNorm2d(5)
    theirs.load_state_dict(ours.state_dict())

    def as_layout(t):
        if layout == "channels_last_memory":
            return t.contiguous(memory_format=torch.channels_last)
        return t.movedim(1, -1).contiguous() if layout == "channel_last" else t

    xs, zs = (as_layout(t).requires_grad_() for t in (x, z))
    out = ours(xs, zs) if with_z else ours(xs)
    if with_z and dtype != torch.float32:
        assert not graph_reaches(out.grad_fn, "NativeBatchNorm", depth=6), out.grad_fn
        return
    assert graph_reaches(out.grad_fn, "NativeBatchNorm", depth=6), out.grad_fn
    out.backward(as_layout(dy))
    xt, zt = (t.detach().clone().requires_grad_() for t in (x, z))
    want = torch.relu(theirs(xt) + zt) if with_z else torch.relu(theirs(xt))
    want.backward(dy)
    got = out.movedim(-1, 1) if layout == "channel_last" else out
    # torch's kernels for another memory layout sum in another order: equal up to rounding
    close(got, want, dtype, "output")
    for what, a, b in (("input grad", xs.grad, xt.grad), ("z grad", zs.grad, zt.grad))[: 1 + with_z]:
        close(a.movedim(-1, 1) if layout == "channel_last" else a, b, dtype, what)
    for name in ("weight", "bias"):
        close(getattr(ours, name).grad, getattr(theirs, name).grad, dtype, name + " grad")
    for name in ("running_mean", "running_var"):
        close(getattr(ours, name), getattr(theirs, name), torch.float32, name)
    assert int(ours.num_batches_tracked) == int(theirs.num_batches_tracked) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_masked_gradient_from_the_reduction(device, dtype, monkeypatch):
    """A fused-ReLU norm with z's gradient, the masked gradient written by the reduction and read by
    the plain input-gradient kernel (sync_batchnorm._MASKED_IN_REDUCE, the default) or made by the fused
    input-gradient kernel: both match torch's batch norm, z's gradients equal."""
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("bf16: the CUDA kernels' case (the CPU reference is the same code either way)")
    case = dict(name="masked", shape=(16, 6, 5), layout="channels_last_memory", seed=7, batches=[6], relu=True)
    results = []
    for masked_first in (False, True):
        monkeypatch.setattr(sync_batchnorm, "_MASKED_IN_REDUCE", masked_first)
        module = make_module(case, device, dtype)
        results.append(run_module(module, case, slice(0, 6), device, dtype))
        check_ranks(case, results[-1:], dtype)
    assert (results[0]["grad_z"] == results[1]["grad_z"]).all()
    for key in ("grad_input", "grad_weight", "grad_bias"):
        close(torch.from_numpy(results[1][key]), torch.from_numpy(results[0][key]), dtype, key)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["nchw", "channels_last_memory", "channel_last"])
def test_single_gpu_low_precision(dtype, layout):
    case = dict(name=f"{layout}-{dtype}", shape=(24, 9, 7), layout=layout, seed=3, batches=[6], relu=True)
    module = make_module(case, "cuda", dtype)
    got = run_module(module, case, slice(0, 6), "cuda", dtype)
    check_ranks(case, [got], dtype)


def test_state_dict_matches_torch_batchnorm():
    ours = SyncBatchNorm(5)
    theirs = torch.nn.BatchNorm2d(5)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    assert isinstance(ours, torch.nn.modules.batchnorm._BatchNorm)
    assert optimized_sync_batchnorm.SyncBatchNorm is SyncBatchNorm


def test_convert_syncbn_model():
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3),
        torch.nn.BatchNorm2d(4),
        torch.nn.Sequential(torch.nn.BatchNorm1d(6, momentum=None, affine=False), torch.nn.ReLU()),
        torch.nn.BatchNorm3d(2, track_running_stats=False),
        SyncBatchNorm(3),
    ).double()
    model[1].weight.requires_grad_(False)
    model[1].running_mean.fill_(0.25)
    model.eval()
    original = copy.deepcopy(model)
    kept = model[4]
    converted = convert_syncbn_model(model, channel_last=True)
    assert converted is model
    for path, old in [("1", original[1]), ("2.0", original[2][0]), ("3", original[3])]:
        new = converted.get_submodule(path)
        assert type(new) is SyncBatchNorm and new.channel_last
        assert (new.momentum, new.eps, new.affine, new.track_running_stats) == (
            old.momentum,
            old.eps,
            old.affine,
            old.track_running_stats,
        )
        assert not new.training
        for key, value in old.state_dict().items():
            assert torch.equal(new.state_dict()[key], value) and new.state_dict()[key].dtype == value.dtype
    assert not converted[1].weight.requires_grad and converted[1].bias.requires_grad
    assert converted[4] is kept
    single = convert_syncbn_model(torch.nn.BatchNorm1d(3))
    assert isinstance(single, SyncBatchNorm)


def test_create_syncbn_process_group_zero_is_world():
    assert create_syncbn_process_group(0) is None


def test_bad_module_input():
    with pytest.raises(ValueError, match="at least 2-D"):
        SyncBatchNorm(3)(torch.randn(3))
    with pytest.raises(ValueError, match="input has 4 channels, expected 3"):
        SyncBatchNorm(3)(torch.randn(2, 4, 5))
    with pytest.raises(ValueError, match="z has shape"):
        SyncBatchNorm(3, fuse_relu=True)(torch.randn(2, 3, 5), torch.randn(2, 3, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nchw", "channels_last_memory", "channel_last"])
def test_torch_compile_module_fullgraph(layout):
    case = dict(name=layout, shape=(8, 5, 5), layout=layout, seed=4, batches=[4], relu=layout == "channel_last")
    eager = make_module(case, "cuda", torch.bfloat16)
    compiled_module = copy.deepcopy(eager)
    compiled = torch.compile(compiled_module, fullgraph=True)
    x, _, dy, z, _, _ = case_data(case)
    x = to_layout(x.cuda().bfloat16(), layout)
    dy = to_layout(dy.cuda().bfloat16(), layout)
    z = None if z is None else to_layout(z.cuda().bfloat16(), layout)
    outs = []
    for module, fn in ((eager, eager), (compiled_module, compiled)):
        xi = x.clone().requires_grad_()
        out = fn(xi, z) if z is not None else fn(xi)
        out.backward(dy)
        outs.append((out.detach(), xi.grad, module.weight.grad, module.running_mean.clone()))
    for a, b in zip(*outs):
        close(b, a, torch.bfloat16, "compiled vs eager")


class _FusedBottleneck(torch.nn.Module):
    """Convolutions between fused batch norms, as a channels-last ResNet bottleneck uses them: the
    norms' saved inputs are (N, H, W, C) views of convolution outputs laid out by Inductor."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, channels, 1, bias=False)
        self.bn1 = SyncBatchNorm(channels, fuse_relu=True)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = SyncBatchNorm(channels, fuse_relu=True)
        self.conv3 = torch.nn.Conv2d(channels, channels, 1, bias=False)
        self.bn3 = SyncBatchNorm(channels, fuse_relu=True)

    def forward(self, x):
        out = self.bn2(self.conv2(self.bn1(self.conv1(x))))
        return self.bn3(self.conv3(out), x)


def test_torch_compile_between_channels_last_convolutions(device):
    """Compiled as eager. On the H200 a whole channels-last ResNet-50 failed to compile before the
    ops carried the contiguous-inputs tag (Inductor's layout optimization: the backward graph's
    fake tensor propagation gave relu_backward_c_last a non-contiguous saved input)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(_FusedBottleneck(16), _FusedBottleneck(16)).to(device)
    net = net.to(memory_format=torch.channels_last)
    x = torch.randn(4, 16, 7, 7, device=device).to(memory_format=torch.channels_last)
    results = []
    for fn in (net, torch.compile(copy.deepcopy(net), fullgraph=True)):
        out = fn(x)  # x needs no gradient: the first block's input is a leaf without one
        out.sum().backward()
        results.append([out.detach()] + [p.grad for p in getattr(fn, "_orig_mod", fn).parameters()])
    for a, b in zip(*results):
        close(b, a, torch.float32, "compiled vs eager")


def test_torch_compile_layout_optimization_copies_nothing(device):
    """Under Inductor's layout optimization (on for CUDA convolution graphs, forced here so the CPU
    checks it too) no generated kernel copies our ops' inputs or outputs. The norms once passed
    (N, H, W, C) permutations of the convolutions' outputs, which the optimization gave 4-D
    channels-last strides and copied (17.5 ms of a ResNet-50 step on the H200)."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    net = torch.nn.Sequential(_FusedBottleneck(16), _FusedBottleneck(16)).to(device)
    net = net.to(memory_format=torch.channels_last)
    x = torch.randn(4, 16, 7, 7, device=device).to(memory_format=torch.channels_last)
    compiled = torch.compile(net, fullgraph=True)

    def step():
        compiled(x).sum().backward()

    with torch._inductor.config.patch(force_layout_optimization=True):
        _, sources = run_and_get_code(step)
    assert len(sources) == 2, "expected a forward and a backward graph"
    kernels = set(re.findall(r"\b(?:cpp|triton)_\w*?fused_\w+", "\n".join(sources)))
    ours = ("welford", "batch_norm", "reduce_bn", "relu_backward")
    copies = sorted(k for k in kernels if any(name in k for name in ours))
    assert not copies, f"generated kernels around apex_parallel's ops: {copies}"
