"""What the contrib optimizers share about their state."""

from __future__ import annotations

import torch


def load_state_keeping_dtypes(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    """``torch.optim.Optimizer.load_state_dict``, then each saved state tensor copied in again in
    its saved dtype: torch casts floating state to its parameter's dtype, which would round fp32
    moments of fp16/bf16 parameters to 16 bits (and the ops take fp32 state only)."""
    torch.optim.Optimizer.load_state_dict(optimizer, state_dict)
    for saved_group, group in zip(state_dict["param_groups"], optimizer.param_groups):
        for saved_id, param in zip(saved_group["params"], group["params"]):
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if isinstance(value, torch.Tensor):
                    optimizer.state[param][key] = value.to(device=param.device, copy=True)
