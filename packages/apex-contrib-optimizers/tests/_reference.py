"""Float64 references of the contrib optimizers' arithmetic, written from the math (not the code under
test), and what the test modules share. Imported relatively (``from ._reference import ...``): under
pytest's importlib mode the tests folder is a namespace package."""

from __future__ import annotations

import math

import torch

# one, odd, 2-D, not a multiple of any vector width, more than one 65536-element chunk
SHAPES = [(1,), (7,), (33, 5), (4099,), (70001,)]
REDUCED = [torch.float16, torch.bfloat16]


def make_params(dtype, device, shapes=SHAPES):
    return [torch.nn.Parameter(torch.randn(s, dtype=torch.float64).to(dtype=dtype, device=device)) for s in shapes]


def make_grads(params, dtype=None, scale=1.0):
    dtypes = [dtype or p.dtype for p in params]
    return [
        (torch.randn(p.shape, dtype=torch.float64) * scale).to(device=p.device, dtype=d) for p, d in zip(params, dtypes)
    ]


def tolerance(dtype):
    """Ours computes in fp32 and rounds once to ``dtype``; the reference rounds float64 once."""
    if dtype == torch.float32:
        return dict(rtol=1e-5, atol=1e-6)
    if dtype == torch.float64:
        return dict(rtol=1e-6, atol=1e-7)  # fp32 moments: the kernel's math is fp32 where p is not fp64
    eps = torch.finfo(dtype).eps
    return dict(rtol=2 * eps, atol=1e-5)


def assert_close(actual, expected, dtype):
    torch.testing.assert_close(actual.detach().double().cpu(), expected.double().cpu(), **tolerance(dtype))


class ContribAdam:
    """Upstream's contrib Adam on float64 copies: the bias corrections in the step size, eps inside
    or outside the square root, the decay added to the update."""

    def __init__(self, params, lr, betas, eps, weight_decay, eps_inside_sqrt, bias_correction=True):
        self.p = [p.detach().double().clone() for p in params]
        self.m = [torch.zeros_like(p) for p in self.p]
        self.v = [torch.zeros_like(p) for p in self.p]
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        self.inside, self.bias_correction, self.t = eps_inside_sqrt, bias_correction, 0

    def step(self, grads, divisor=1.0, round_to=None):
        self.t += 1
        b1, b2 = self.betas
        s = self.lr
        if self.bias_correction:
            s = self.lr * math.sqrt(1 - b2**self.t) / (1 - b1**self.t)
        for i, g in enumerate(grads):
            g = g.double() / divisor
            self.m[i] = b1 * self.m[i] + (1 - b1) * g
            self.v[i] = b2 * self.v[i] + (1 - b2) * g * g
            denom = (self.v[i] + self.eps).sqrt() if self.inside else self.v[i].sqrt() + self.eps
            self.p[i] = self.p[i] - s * (self.m[i] / denom + self.wd * self.p[i])
            if round_to is not None:  # the stored parameter is what the next step reads
                self.p[i] = self.p[i].to(round_to).double()


class ReferenceSGD:
    def __init__(self, params, lr, momentum, dampening, weight_decay, nesterov, wd_after_momentum):
        self.p = [p.detach().double().clone() for p in params]
        self.buf = [None] * len(self.p)
        self.lr, self.mu, self.tau, self.wd = lr, momentum, dampening, weight_decay
        self.nesterov, self.after = nesterov, wd_after_momentum

    def step(self, grads, divisor=1.0):
        for i, g in enumerate(grads):
            g = g.double() / divisor
            if self.wd and not self.after:
                g = g + self.wd * self.p[i]
            if self.mu:
                self.buf[i] = g.clone() if self.buf[i] is None else self.mu * self.buf[i] + (1 - self.tau) * g
                g = g + self.mu * self.buf[i] if self.nesterov else self.buf[i]
            if self.wd and self.after:
                g = g + self.wd * self.p[i]
            self.p[i] = self.p[i] - self.lr * g


class ReferenceLAMB:
    """LAMB with global-norm clipping, decoupled (adam_w_mode) or L2 decay, trust ratio where decay != 0."""

    def __init__(self, groups, lr, betas, eps, adam_w_mode, grad_averaging, max_grad_norm):
        # groups: [(params, weight_decay)]
        self.groups = [([p.detach().double().clone() for p in ps], wd) for ps, wd in groups]
        self.m = [[torch.zeros_like(p) for p in ps] for ps, _ in self.groups]
        self.v = [[torch.zeros_like(p) for p in ps] for ps, _ in self.groups]
        self.lr, self.betas, self.eps = lr, betas, eps
        self.adam_w, self.averaging, self.max_norm, self.t = adam_w_mode, grad_averaging, max_grad_norm, 0

    def step(self, grads):
        self.t += 1
        b1, b2 = self.betas
        b3 = 1 - b1 if self.averaging else 1.0
        norm = math.sqrt(sum(float(g.double().square().sum()) for gs in grads for g in gs))
        clip = norm / self.max_norm if self.max_norm > 0 and norm > self.max_norm else 1.0
        for gi, ((ps, wd), gs) in enumerate(zip(self.groups, grads)):
            for i, g in enumerate(gs):
                p = ps[i]
                g = g.double() / clip
                if wd and not self.adam_w:
                    g = g + wd * p
                m = self.m[gi][i] = b1 * self.m[gi][i] + b3 * g
                v = self.v[gi][i] = b2 * self.v[gi][i] + (1 - b2) * g * g
                u = (m / (1 - b1**self.t)) / ((v / (1 - b2**self.t)).sqrt() + self.eps)
                if wd and self.adam_w:
                    u = u + wd * p
                ratio = 1.0
                if wd:
                    pn, un = p.norm(), u.norm()
                    ratio = float(pn / un) if pn > 0 and un > 0 else 1.0
                ps[i] = p - self.lr * ratio * u


# flat shards (the distributed ops' inputs) ----------------------------------------------------------

# Element offsets of each list's shards inside their buffers (params, [remainders,] m, v, g, out):
# all 16-byte aligned, all misaligned alike (vector path after a scalar head), misaligned differently
# (the all-scalar path).
OFFSETS = {"aligned": (0,) * 6, "shifted": (3,) * 6, "mixed": (0, 1, 2, 3, 5, 4)}


def shard(values: torch.Tensor, offset: int, dtype=None) -> torch.Tensor:
    """``values`` (as ``dtype``) in a contiguous view starting ``offset`` elements into a larger buffer,
    whose other elements are NaN (or -1 for integers)."""
    dtype = dtype or values.dtype
    fill = float("nan") if dtype.is_floating_point else -1
    buffer = torch.full((values.numel() + offset + 5,), fill, dtype=dtype, device=values.device)
    view = buffer[offset : offset + values.numel()]
    view.copy_(values.reshape(-1))
    return view


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers (NaN == NaN)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).cpu()
