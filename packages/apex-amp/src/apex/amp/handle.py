"""``amp.scale_loss``: scale a loss for its backward, then unscale the gradients and check them."""

from __future__ import annotations

import contextlib
import functools

import torch

from apex.amp._amp_state import _amp_state, is_optimizer
from apex.amp._multi_tensor import scale_into
from apex.amp.casting import disable_casts  # noqa: F401  (re-exported: upstream's amp.handle.disable_casts)
from apex.amp.optimizer_state import AmpOptimizerState


def _stashes(optimizers) -> list[AmpOptimizerState]:
    if is_optimizer(optimizers):
        optimizers = [optimizers]
    stashes, seen = [], set()
    for optimizer in optimizers:
        stash = getattr(optimizer, "_amp_stash", None)
        if stash is None:
            raise RuntimeError(
                f"amp.scale_loss got a {type(optimizer).__name__} that amp.initialize did not process; pass the "
                "optimizer(s) returned by amp.initialize."
            )
        if id(stash) not in seen:
            seen.add(id(stash))
            stashes.append(stash)
    return stashes


def _clears_cast_cache(scale_loss_cm):
    """On leaving the block normally, drop amp.init's cached parameter casts: their iteration is over."""

    @functools.wraps(scale_loss_cm)
    @contextlib.contextmanager
    def wrapper(*args, **kwargs):
        with scale_loss_cm(*args, **kwargs) as scaled:
            yield scaled
        handle = getattr(_amp_state, "handle", None)
        if handle is not None:
            handle._clear_cache()

    return wrapper


@_clears_cast_cache
@contextlib.contextmanager
def scale_loss(loss, optimizers, loss_id=0, model=None, delay_unscale=False, delay_overflow_check=False):
    """Yield ``loss`` (as fp32) times the loss scale of ``loss_id``; call ``.backward()`` on it inside the block.

    On leaving the block the gradients of ``optimizers``' parameters are unscaled (into the fp32
    masters' ``.grad`` where amp keeps masters) and checked for inf/NaN in the same pass; a dynamic
    scale then backs off on an overflow or grows after enough clean steps, and the next
    ``optimizer.step()`` of each of these optimizers is skipped if an overflow was found. All of
    this stays on the device.

    Args:
        loss: the loss tensor.
        optimizers: the optimizer (or list) whose parameters receive this loss's gradients.
        loss_id: which loss scaler, ``0 <= loss_id < num_losses``.
        model: accepted for compatibility; unused.
        delay_unscale: leave the gradients scaled and unchecked (gradient accumulation: pass True for
            every backward but the last before ``step()``; the last one unscales them all).
        delay_overflow_check: unscale, but neither update the scale nor skip the step (upstream's
            hook for optimizers that check overflow themselves).
    """
    properties = _amp_state.opt_properties
    if properties is None:
        raise RuntimeError(
            "Invoked 'with amp.scale_loss`, but internal Amp state has not been initialized.  model, optimizer = "
            "amp.initialize(model, optimizer, opt_level=...) must be called before `with amp.scale_loss`."
        )
    if not properties.enabled:
        yield loss
        return
    stashes = _stashes(optimizers)
    if not 0 <= loss_id < len(_amp_state.loss_scalers):
        raise RuntimeError(
            f"loss_id={loss_id}, but amp.initialize was called with num_losses={len(_amp_state.loss_scalers)}"
        )
    scaler = _amp_state.loss_scalers[loss_id]
    unscale_own_grads = not scaler.is_static_one()
    if not unscale_own_grads and not any(stash.amp_masters for stash in stashes):
        yield loss.float()
        return

    if not delay_unscale:
        for stash in stashes:
            stash.prepare_backward(unscale_own_grads)
    try:
        if unscale_own_grads:
            yield loss.float() * scaler.scale_tensor(loss.device).reshape(())
        else:
            yield loss.float()
    except BaseException:
        for stash in stashes:
            stash.restore_after_failed_backward()
        raise

    if delay_unscale:
        for stash in stashes:
            stash.grads_are_scaled = True
        return
    inputs, outputs, additions = [], [], []
    for stash in stashes:
        stash.collect_unscale(inputs, outputs, additions, unscale_own_grads)
        stash.grads_are_scaled = False
    scaler.begin_check()
    inv_scales: dict[torch.device, torch.Tensor] = {}

    def inv_scale_on(device):
        if not unscale_own_grads:
            return None
        if device not in inv_scales:
            inv_scales[device] = scaler.inv_scale_tensor(device)
            scaler.check_inverse(inv_scales[device], device)
        return inv_scales[device]

    with torch.no_grad():
        scale_into(inputs, outputs, inv_scale_on, scaler.flag_on)
        for target, addend in additions:
            target.add_(addend)
    if scaler.dynamic and not delay_overflow_check:
        found_inf = scaler.found_inf()
        scaler.update_scale(found_inf)
        for stash in stashes:
            stash.note_overflow(found_inf, loss_id, scaler)
