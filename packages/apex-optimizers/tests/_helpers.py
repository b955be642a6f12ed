"""What the optimizer tests share: parameters, gradients, runs, and how closely ours must follow.

Two ways to check an optimizer: against a torch.optim twin (``run``; fp16/bf16 parameters then
follow an fp32 emulation, see ``assert_follows_emulation``) or against a float64 reference
written in the test file (``run_with_reference``, ``assert_follows_reference``).

The test modules import this one relatively (``from ._helpers import ...``): under pytest's
importlib mode the tests folder is a namespace package, not a folder on ``sys.path``.
"""

from __future__ import annotations

import torch

# empty, one, odd, 2-D, not a multiple of any vector width, more than one 65536-element chunk
SHAPES = [(0,), (1,), (7,), (33, 5), (4099,), (70001,)]
STEPS = 20
REDUCED = [torch.float16, torch.bfloat16]
FP32_TOL = dict(rtol=1e-5, atol=1e-6)
# With L2 weight decay the first step divides g + wd*theta, which can cancel to near zero, by its
# own magnitude plus eps, so one fp32 rounding of that sum (kernels may fuse it differently) moves
# the update by up to rounding/eps. The L2 cases take an eps that keeps this below the tolerance.
L2_EPS = 1e-3
# Which parameters of three have a gradient at each of 8 steps: the first every step, the second
# from the fourth step on, the third every other step (three step counts in one bucket).
STAGGERED = [[0] + ([1] if step >= 3 else []) + ([2] if step % 2 == 0 else []) for step in range(8)]


def make_params(dtype, device, shapes=SHAPES):
    return [torch.nn.Parameter(torch.randn(s, dtype=torch.float64).to(dtype=dtype, device=device)) for s in shapes]


def fp32_copies(params):
    return [torch.nn.Parameter(p.detach().float().clone()) for p in params]


def random_grads(params):
    return [torch.randn(p.shape, dtype=torch.float64).to(dtype=p.dtype, device=p.device) for p in params]


def hypers_of(optimizer, keys):
    """Each parameter's group hyper-parameters named ``keys``, in parameter order."""
    return [{k: group[k] for k in keys} for group in optimizer.param_groups for _ in group["params"]]


def _assert_within_two_ulps(param, expected, peak, followed):
    """fp16/bf16 within two units in the last place of their dtype at the largest magnitude the
    element reached: where our fp32 update and that of what is followed straddle a rounding
    boundary, the rounded parameters part by one unit, and the gap stays as the parameter moves on."""
    gap = (param.detach().double() - expected.detach().double()).abs()
    bound = 2 * torch.finfo(param.dtype).eps * peak.double() + 1e-6
    assert bool((gap <= bound).all()), (
        f"{param.dtype} parameter of shape {tuple(param.shape)} strays from the {followed} by "
        f"{(gap - bound).max().item():.3g} beyond two units in the last place"
    )


def assert_follows_emulation(param, twin, peak):
    """fp32 params as the twin; fp16/bf16 params within two units in the last place (above)."""
    if param.dtype == torch.float32:
        torch.testing.assert_close(param, twin, **FP32_TOL)
        return
    _assert_within_two_ulps(param, twin, peak, "emulation")


def assert_follows_reference(param, expected, peak, atol=FP32_TOL["atol"]):
    """fp32 as the float64 reference within fp32 rounding; fp16/bf16, rounded every step, within
    two units in the last place (above)."""
    if param.dtype == torch.float32:
        torch.testing.assert_close(param.detach().double(), expected, rtol=FP32_TOL["rtol"], atol=atol)
        return
    _assert_within_two_ulps(param, expected, peak, "reference")


def step_on_fresh_grads(optimizer, params, steps=STEPS):
    """Step ``optimizer`` ``steps`` times, each on fresh gradients; return each step's gradients."""
    history = []
    for _ in range(steps):
        grads = random_grads(params)
        history.append(grads)
        for p, g in zip(params, grads):
            p.grad = g
        optimizer.step()
    return history


def step_on_some_grads(optimizer, params, schedule):
    """Step once per entry of ``schedule``: a fresh gradient for the parameters it lists, None for
    the others; return each step's gradients."""
    history = []
    for active in schedule:
        grads = [torch.randn(p.shape, device=p.device) if i in active else None for i, p in enumerate(params)]
        for p, g in zip(params, grads):
            p.grad = g
        optimizer.step()
        history.append(grads)
    return history


class Float64Reference:
    """What the float64 references share: float64 copies of the parameters, each parameter's group
    hyper-parameters (``hypers``, see ``hypers_of``) and its own step count, and the largest
    magnitude each element reached (``peaks``, for ``assert_follows_reference``)."""

    def __init__(self, params, hypers, step=0):
        self.theta = [p.detach().double().clone() for p in params]
        self.dtypes = [p.dtype for p in params]
        self.hypers = hypers
        self.t = [step] * len(self.theta)
        self.peaks = [t.abs() for t in self.theta]

    def _stepping(self, grads):
        """(index, float64 gradient, step count, hyper-parameters) of each parameter stepped now,
        its step counted: a parameter whose gradient is None skips the step, and its count stays."""
        for i, g in enumerate(grads):
            if g is None:
                continue
            self.t[i] += 1
            yield i, g.double(), self.t[i], self.hypers[i]

    def _store(self, i, theta, round_param):
        """The parameter's new value, rounded to its dtype first when ``round_param``."""
        if round_param and self.dtypes[i] != torch.float32:
            theta = theta.to(self.dtypes[i]).double()
        self.theta[i] = theta
        self.peaks[i] = torch.maximum(self.peaks[i], theta.abs())


def run_with_reference(optimizer, params, reference, steps=STEPS):
    """Step the optimizer and the float64 reference on the same fresh gradients."""
    for grads in step_on_fresh_grads(optimizer, params, steps):
        reference.step(grads)


def run(ours, theirs, params, twins, steps=STEPS, round_twins=False):
    """Step both on the same fresh gradients (upcast for the twins); return each twin's
    elementwise peak magnitude over the run."""
    peaks = [t.detach().abs() for t in twins]
    for _ in range(steps):
        for p, t, g in zip(params, twins, random_grads(params)):
            p.grad = g
            t.grad = g.to(t.dtype)
        ours.step()
        theirs.step()
        if round_twins:
            with torch.no_grad():
                for p, t in zip(params, twins):
                    t.copy_(t.to(p.dtype))
        peaks = [torch.maximum(peak, t.detach().abs()) for peak, t in zip(peaks, twins)]
    return peaks


def assert_masters_follow_torch(make_ours, torch_class, dtype, device, **hyper):
    """fp16/bf16 parameters (and fp32 ones) under ``make_ours(params, master_weights=True, **hyper)``
    against ``torch_class`` on fp32 twins: each 16-bit parameter's fp32 master in the state follows
    the twin, the parameter is the master rounded to its dtype; fp32 parameters get no master.
    Returns the optimizer and its 16-bit parameters."""
    reduced = make_params(dtype, device)
    params = reduced + make_params(torch.float32, device, [(5, 3), (1000,)])
    twins = fp32_copies(params)
    initial = [p.detach().clone() for p in params]
    ours = make_ours(params, master_weights=True, **hyper)
    run(ours, torch_class(twins, **hyper), params, twins)
    for p, t, p0 in zip(params, twins, initial):
        state = ours.state[p]
        if p.dtype == torch.float32:
            assert "master_param" not in state
            torch.testing.assert_close(p, t, **FP32_TOL)
            continue
        master = state["master_param"]
        assert master.dtype == torch.float32 and master.device == p.device and master.shape == p.shape
        torch.testing.assert_close(master, t.detach(), **FP32_TOL)
        if p.numel():
            assert not torch.equal(master, p0.float()), "the master weights did not move"
        assert torch.equal(p.detach(), master.to(dtype)), "params must be the masters rounded to their dtype"
    return ours, reduced


def assert_tensor_lr_equals_float_lr(optimizer_class, device, lr, **hyper):
    """A learning rate given as a tensor steps fp32 parameters as the same float does."""
    params = make_params(torch.float32, device)
    twins = fp32_copies(params)
    with_tensor = optimizer_class(params, lr=torch.tensor(lr, device=device), **hyper)
    with_float = optimizer_class(twins, lr=lr, **hyper)
    run(with_tensor, with_float, params, twins, steps=5)
    for p, t in zip(params, twins):
        torch.testing.assert_close(p, t, **FP32_TOL)


def assert_param_groups_follow_torch(optimizer_class, torch_class, device, group_a, group_b, **defaults):
    """Two groups with their own hyper-parameters (and ``defaults`` for the rest) step as torch's."""
    first, second = make_params(torch.float32, device, SHAPES[:3]), make_params(torch.float32, device, SHAPES[3:])
    twins_first, twins_second = fp32_copies(first), fp32_copies(second)
    ours = optimizer_class([{"params": first, **group_a}, {"params": second, **group_b}], **defaults)
    theirs = torch_class([{"params": twins_first, **group_a}, {"params": twins_second, **group_b}], **defaults)
    run(ours, theirs, first + second, twins_first + twins_second)
    for p, t in zip(first + second, twins_first + twins_second):
        torch.testing.assert_close(p, t, **FP32_TOL)
