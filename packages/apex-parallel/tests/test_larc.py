"""LARC against a float64 reference written from the formula, around torch.optim.SGD."""

from __future__ import annotations

import pytest
import torch

from apex.parallel import LARC

SHAPES = [(1,), (7,), (33, 5), (4, 3, 2)]


def reference_step(params, grads, lr, weight_decay, trust, clip, eps):
    """One SGD step on float64 copies with LARC's adaptive rate, per parameter."""
    out = []
    for p, g in zip(params, grads):
        p, g = p.double(), g.double()
        pn, gn = p.norm(), g.norm()
        if pn != 0 and gn != 0:
            rate = trust * pn / (gn + pn * weight_decay + eps)
            if clip:
                rate = min(rate / lr, 1.0)
            g = (g + weight_decay * p) * rate
        out.append(p - lr * g)
    return out


@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_larc_matches_reference(clip, weight_decay, dtype, device):
    lr, trust, eps = 0.5, 0.02, 1e-8
    params = [torch.nn.Parameter(torch.randn(s, dtype=dtype, device=device)) for s in SHAPES]
    with torch.no_grad():
        params[0].zero_()  # a zero parameter is left alone
    optimizer = LARC(torch.optim.SGD(params, lr=lr, weight_decay=weight_decay), trust_coefficient=trust, clip=clip)
    for step in range(3):
        grads = [torch.randn_like(p) * (10.0 if step == 1 else 1e-3) for p in params]  # both sides of the clip
        if step == 2:
            grads[-1].zero_()  # a zero gradient is left alone too
        expected = reference_step([p.detach() for p in params], grads, lr, weight_decay, trust, clip, eps)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.step()
        tol = 1e-6 if dtype == torch.float32 else 1e-12
        for p, e in zip(params, expected):
            torch.testing.assert_close(p.detach().double(), e, rtol=tol, atol=tol)
        assert optimizer.param_groups[0]["weight_decay"] == weight_decay  # restored after the inner step


def test_larc_delegates():
    params = [torch.nn.Parameter(torch.randn(3))]
    inner = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    larc = LARC(inner)
    assert larc.param_groups is inner.param_groups
    extra = torch.nn.Parameter(torch.randn(2))
    larc.add_param_group({"params": [extra], "lr": 0.2})
    assert len(inner.param_groups) == 2
    for p in (*params, extra):
        p.grad = torch.ones_like(p)
    larc.step()
    state = larc.state_dict()
    assert len(state["state"]) == 2 and state == inner.state_dict()
    copy = [torch.nn.Parameter(p.detach().clone()) for p in (*params, extra)]
    restored = LARC(torch.optim.SGD([{"params": copy[:1]}, {"params": copy[1:], "lr": 0.2}], lr=0.1, momentum=0.9))
    restored.load_state_dict(state)
    for a, b in zip(restored.state.values(), inner.state.values()):
        torch.testing.assert_close(a["momentum_buffer"], b["momentum_buffer"])
    larc.zero_grad()
    assert all(p.grad is None for p in (*params, extra))
    assert larc.state is inner.state


def test_larc_takes_the_optimizer_hooks_amp_uses():
    """amp.initialize keeps its bookkeeping on the optimizer it is given (``_amp_stash``), replaces its
    step/zero_grad/add_param_group, and registers state-dict hooks that read that bookkeeping: on a
    LARC, the hooks must see the LARC (not the wrapped optimizer) and the replaced methods must win."""
    params = [torch.nn.Parameter(torch.randn(3))]
    larc = LARC(torch.optim.SGD(params, lr=0.1, momentum=0.9))
    larc._amp_stash = "stash"
    seen = []

    def save(optimizer, state_dict):
        seen.append(("save", optimizer, optimizer._amp_stash))
        state_dict["extra"] = 1
        return state_dict

    def take(optimizer, state_dict):
        seen.append(("take", optimizer, state_dict.pop("extra")))
        return state_dict

    handles = [
        larc.register_state_dict_pre_hook(lambda optimizer: seen.append(("pre-save", optimizer))),
        larc.register_state_dict_post_hook(save),
        larc.register_load_state_dict_pre_hook(take),
        larc.register_load_state_dict_post_hook(lambda optimizer: seen.append(("loaded", optimizer))),
        larc.register_step_pre_hook(lambda optimizer, args, kwargs: seen.append(("pre-step", optimizer))),
        larc.register_step_post_hook(lambda optimizer, args, kwargs: seen.append(("post-step", optimizer))),
    ]
    params[0].grad = torch.ones(3)
    larc.step()
    state = larc.state_dict()
    assert state["extra"] == 1
    larc.load_state_dict(state)
    assert seen == [
        ("pre-step", larc),
        ("post-step", larc),
        ("pre-save", larc),
        ("save", larc, "stash"),
        ("take", larc, 1),
        ("loaded", larc),
    ]
    for handle in handles:
        handle.remove()
    seen.clear()
    larc.step()
    assert "extra" not in larc.state_dict() and seen == []
    # amp replaces the methods on the instance; the replacements are what callers then get
    larc.step = lambda: "patched"
    assert larc.step() == "patched"
    assert getattr(larc, "_step_supports_amp_scaling", False) is False  # LARC's step reads the gradients


def test_larc_bad_arguments():
    with pytest.raises(TypeError, match="optimizer"):
        LARC([torch.nn.Parameter(torch.ones(1))])
    with pytest.raises(ValueError, match="trust_coefficient"):
        LARC(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1), trust_coefficient=0.0)
