"""One process of the checkpoint test (test_checkpoint.py runs it twice).

    python _checkpoint_worker.py full DEVICE OUTDIR     # train STEPS steps, checkpoint after RESUME_AT
    python _checkpoint_worker.py resume DEVICE OUTDIR   # new process: initialize, load, train the rest

Each configuration follows upstream's README: amp.initialize, then model, optimizer and amp
state saved together; on resume amp.initialize first, then the three load_state_dict calls.
Overflows are injected before and after the checkpoint so that the loss scaler's state matters.
Writes OUTDIR/<phase>.pt: per configuration the losses and loss scales of every step it ran and
the final model, optimizer and amp state.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from torch import nn

from apex import amp

STEPS, RESUME_AT, OVERFLOW_AT = 9, 4, (2, 6)


def configs() -> dict:
    """name -> (opt level, initialize overrides, optimizer, whether to inject overflows)."""
    dynamic = dict(loss_scale="dynamic")
    out = {}
    for hname, half in {"fp16": torch.float16, "bf16": torch.bfloat16}.items():
        out[f"O2-{hname}-adamw"] = ("O2", dict(cast_model_type=half, **dynamic), "adamw", True)
        out[f"O2-{hname}-fused_adam"] = ("O2", dict(cast_model_type=half, **dynamic), "fused_adam", True)
        out[f"O1-{hname}-sgd"] = ("O1", dict(autocast_dtype=half, **dynamic), "sgd", True)
    # bf16's default static scale of 1.0 (FusedAdam's own masters): nothing to skip, so no overflows.
    out["O2-bf16-fused_adam-static"] = ("O2", dict(cast_model_type=torch.bfloat16), "fused_adam", False)
    out["O3-bf16-sgd"] = ("O3", dict(cast_model_type=torch.bfloat16, **dynamic), "sgd", True)
    out["O0-adamw_fused"] = ("O0", dynamic, "adamw_fused", True)
    if importlib.util.find_spec("apex.optimizers") is None:  # apex-amp tested without apex-optimizers
        out = {name: config for name, config in out.items() if config[2] != "fused_adam"}
    return out


def build(device: str, seed: int, opt_name: str):
    torch.manual_seed(seed)
    norm = nn.BatchNorm1d(32) if device == "cpu" else nn.LayerNorm(32)
    model = nn.Sequential(nn.Linear(8, 32), norm, nn.GELU(), nn.Linear(32, 4)).to(device)
    if opt_name == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    elif opt_name == "adamw_fused":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    elif opt_name == "fused_adam":
        from apex.optimizers import FusedAdam

        opt = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=5e-2, momentum=0.9)
    return model, opt


def batch(step: int, device: str):
    gen = torch.Generator().manual_seed(500 + step)
    return torch.randn(32, 8, generator=gen).to(device), torch.randn(32, 4, generator=gen).to(device)


def train_steps(model, opt, device, steps, inject, on_step=None):
    losses, scales = [], []
    for step in steps:
        x, y = batch(step, device)
        loss = (model(x).float() - y).square().mean()
        opt.zero_grad()
        poison = float("inf") if inject and step in OVERFLOW_AT else 1.0
        with amp.scale_loss(loss * poison, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.detach().clone())
        scales.append(amp._amp_state.loss_scalers[0].loss_scale())
        if on_step is not None:
            on_step(step)
    return torch.stack(losses).cpu(), scales


def main(phase: str, device: str, outdir: Path) -> None:
    torch.set_num_threads(1)
    results = {}
    for name, (level, kwargs, opt_name, inject) in configs().items():
        checkpoint = outdir / f"ckpt-{name}.pt"
        if phase == "full":
            model, opt = build(device, seed=0, opt_name=opt_name)
            model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, **kwargs)

            def save(step, model=model, opt=opt, checkpoint=checkpoint):
                if step == RESUME_AT - 1:
                    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": amp.state_dict()}
                    torch.save(state, checkpoint)

            losses, scales = train_steps(model, opt, device, range(STEPS), inject, save)
        else:
            model, opt = build(device, seed=123, opt_name=opt_name)  # a different init: loading must matter
            model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, **kwargs)
            state = torch.load(checkpoint, weights_only=False)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            amp.load_state_dict(state["amp"])
            losses, scales = train_steps(model, opt, device, range(RESUME_AT, STEPS), inject)
        results[name] = {
            "losses": losses,
            "scales": scales,
            "model": {k: v.cpu() for k, v in model.state_dict().items()},
            "params": [p.detach().cpu() for p in model.parameters()],
            "optimizer": opt.state_dict(),
            "amp": amp.state_dict(),
        }
    torch.save(results, outdir / f"{phase}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
