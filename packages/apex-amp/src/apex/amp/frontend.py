"""``amp.initialize``: choose an opt level, apply overrides, and prepare models and optimizers."""

from __future__ import annotations

import sys
import types

import torch

from apex.amp import casting
from apex.amp._amp_state import _amp_state, is_optimizer, maybe_print, warn_or_err
from apex.amp.amp import init as amp_init
from apex.amp.checkpoint import attach_model_hooks
from apex.amp.opt_levels import Properties, opt_levels
from apex.amp.optimizer_state import process_optimizer
from apex.amp.scaler import LossScaler, check_limits
from apex.fp16_utils.fp16util import convert_network


def initialize(
    models,
    optimizers=None,
    enabled=True,
    opt_level="O1",
    cast_model_type=None,
    patch_torch_functions=None,
    keep_batchnorm_fp32=None,
    master_weights=None,
    loss_scale=None,
    cast_model_outputs=None,
    num_losses=1,
    verbosity=1,
    min_loss_scale=None,
    max_loss_scale=2.0**24,
    *,
    autocast_dtype=None,
    hysteresis=1,
):
    """Prepare models and optimizers for mixed-precision training at an optimization level.

    Call it once, after the models are on their device and the optimizers are built, and before
    wrapping models in ``DistributedDataParallel``. Models and optimizers come back in the form
    they were given (one, or a list).

    Levels (``opt_level``, the letter O and a digit):

    * ``"O0"``: fp32 throughout (inputs cast to fp32), no loss scaling. The accuracy baseline.
    * ``"O1"``: weights stay fp32; :func:`apex.amp.init` patches torch's functions by upstream's
      lists, process-wide, so that matmuls and convolutions run in fp16 (or ``autocast_dtype``)
      and softmax, reductions and losses in fp32, on CUDA tensors; each optimizer's ``step`` runs
      without these casts; dynamic loss scaling.
    * ``"O2"``: the model is cast to fp16 (``cast_model_type``) except batch norm, floating inputs
      are cast on the way in and outputs to fp32 on the way out; fp32 master weights; dynamic
      loss scaling.
    * ``"O3"``: everything fp16, no master weights, loss scale 1.0.

    With bf16 (``cast_model_type=torch.bfloat16`` at O2/O3, ``autocast_dtype=torch.bfloat16`` at
    O1) the loss scale defaults to a static 1.0, since bf16 has fp32's range; pass
    ``loss_scale="dynamic"`` to keep dynamic scaling.

    Args:
        models: a module or a list of modules, fp32, not yet wrapped in (Distributed)DataParallel.
        optimizers: an optimizer, a list of them, or None. Any ``torch.optim`` optimizer works;
            apex-optimizers' fused optimizers keep the master weights themselves where exact.
        enabled: False makes this and ``amp.scale_loss`` do nothing.
        opt_level: ``"O0"``, ``"O1"``, ``"O2"`` or ``"O3"``.
        cast_model_type: the dtype the model is cast to (O0/O2/O3).
        patch_torch_functions: cast around torch's functions with :func:`apex.amp.init` (O1 only).
        keep_batchnorm_fp32: keep batch-norm layers in fp32 when casting the model.
        master_weights: keep fp32 master weights for the optimizers.
        loss_scale: a number (static) or ``"dynamic"``.
        cast_model_outputs: the dtype floating outputs are cast to (default: fp32 at O2/O3, none at O1).
        num_losses: how many losses get their own loss scaler (``loss_id`` in ``amp.scale_loss``).
        verbosity: 0 silent, 1 the chosen options and skipped steps, 2 more.
        min_loss_scale: lower clamp of a dynamic scale (None: 2**-24, ``scaler.DEFAULT_MIN_LOSS_SCALE``;
            upstream had no floor, and a long run of overflows could take the scale to 0.0).
        max_loss_scale: upper clamp (and ceiling of the initial 2**16) of a dynamic scale.
        autocast_dtype: (keyword) O1's cast dtype, ``torch.float16`` (default) or ``torch.bfloat16``.
        hysteresis: (keyword) consecutive overflows before a dynamic scale backs off (default 1).

    Returns:
        ``models`` if ``optimizers`` is None, else ``(models, optimizers)``.
    """
    _amp_state.verbosity = verbosity
    if not enabled:
        _amp_state.opt_properties = Properties()
        return models if optimizers is None else (models, optimizers)
    if opt_level not in opt_levels:
        raise RuntimeError(
            f"Unexpected optimization level {opt_level}. Options are 'O0', 'O1', 'O2', 'O3'.  Note that in "
            "`O0`, `O1`, etc., the prefix O is the letter O, not the number zero."
        )
    # Checked before amp's state changes: a refused call leaves the previous initialize in force.
    min_loss_scale, max_loss_scale = check_limits(min_loss_scale, max_loss_scale)
    _check_models([m for m in _model_list(models) if m is not None])
    _check_not_initialized(models)
    _check_no_meta_tensors(models)
    properties = opt_levels[opt_level](Properties())
    maybe_print(f"Selected optimization level {opt_levels[opt_level].brief}", True)
    maybe_print("Defaults for this optimization level are:", True)
    for name, value in properties.options.items():
        maybe_print(f"{name:22} : {value}", True)

    maybe_print("Processing user overrides (additional kwargs that are not None)...", True)
    overrides = {
        "enabled": enabled,
        "opt_level": opt_level,
        "cast_model_type": cast_model_type,
        "patch_torch_functions": patch_torch_functions,
        "keep_batchnorm_fp32": keep_batchnorm_fp32,
        "master_weights": master_weights,
        "loss_scale": loss_scale,
        "autocast_dtype": autocast_dtype,
    }
    for name, value in overrides.items():
        if value is not None:
            setattr(properties, name, value)
    if loss_scale is None and properties.loss_scale == "dynamic" and properties.half_dtype() == torch.bfloat16:
        properties.loss_scale = 1.0
        maybe_print("bf16 has fp32's exponent range: loss_scale defaults to 1.0 (pass loss_scale='dynamic' to scale)")
    maybe_print("After processing overrides, optimization options are:", True)
    for name, value in properties.options.items():
        maybe_print(f"{name:22} : {value}", True)

    _amp_state.opt_properties = properties
    _amp_state.min_loss_scale = min_loss_scale
    _amp_state.max_loss_scale = max_loss_scale
    return _initialize(models, optimizers, properties, num_losses, cast_model_outputs, hysteresis)


def _check_models(models) -> None:
    wrappers = [
        (torch.nn.parallel.DistributedDataParallel, "torch.nn.parallel.DistributedDataParallel"),
        (torch.nn.DataParallel, "torch.nn.parallel.DataParallel"),
    ]
    apex_parallel = sys.modules.get("apex.parallel")
    if apex_parallel is not None and hasattr(apex_parallel, "DistributedDataParallel"):
        wrappers.append((apex_parallel.DistributedDataParallel, "apex.parallel.DistributedDataParallel"))
    for model in models:
        for cls, name in wrappers:
            if isinstance(model, cls):
                raise RuntimeError(
                    f"Incoming model is an instance of {name}. Parallel wrappers should only be applied to the "
                    "model(s) AFTER \nthe model(s) have been returned from amp.initialize."
                )


def _model_list(models) -> list:
    """The modules among ``models`` (one, or a list), for checks that run before the type check."""
    candidates = models if isinstance(models, list) else [models]
    return [m if isinstance(m, torch.nn.Module) else None for m in candidates]


def _check_not_initialized(models) -> None:
    """A model amp.initialize already cast (O2/O3) cannot be prepared again: say so, not its dtype."""
    for index, model in enumerate(_model_list(models)):
        if model is None or not hasattr(model, "_amp_state_hooks"):
            continue
        cast = next(
            (t.dtype for t in (*model.parameters(), *model.buffers()) if t.dtype in (torch.float16, torch.bfloat16)),
            None,
        )
        if cast is not None:
            raise RuntimeError(
                f"amp.initialize was already called on models[{index}] (it holds {cast} tensors now). Call "
                "amp.initialize once, with all models and optimizers, and keep using the models and optimizers "
                "it returned; to change the opt_level, start again from the fp32 model."
            )


def _check_no_meta_tensors(models) -> None:
    for index, model in enumerate(_model_list(models)):
        if model is None:
            continue
        for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
            for name, tensor in named:
                if tensor.is_meta:
                    raise ValueError(
                        f"amp.initialize: models[{index}] has {kind} {name} on the meta device; meta tensors are "
                        "not supported (materialize the model first, e.g. model.to_empty(device=...) and load "
                        "its weights)"
                    )


def _check_params_fp32(models) -> None:
    for model in models:
        for kind, named in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
            for name, tensor in named:
                if tensor.dtype in (torch.float16, torch.bfloat16):
                    warn_or_err(
                        f"Found {kind} {name} with dtype {tensor.dtype}, expected torch.float32.\n"
                        "When using amp.initialize, you do not need to call .half() or .bfloat16() on your "
                        "model\nbefore passing it, no matter what optimization level you choose."
                    )


def _check_optimizers(optimizers) -> None:
    from apex.fp16_utils import FP16_Optimizer

    for optimizer in optimizers:
        if isinstance(optimizer, FP16_Optimizer):
            raise RuntimeError(
                "An incoming optimizer is an instance of apex.fp16_utils.FP16_Optimizer. The optimizer(s) passed "
                "to amp.initialize() must be bare \ninstances of either ordinary Pytorch optimizers, or Apex "
                "fused \noptimizers.\n"
            )


def _step_without_casts(optimizer) -> None:
    step = optimizer.step

    def step_without_casts(self, *args, **kwargs):
        with casting.disable_casts():
            result = step(*args, **kwargs)
        handle = getattr(_amp_state, "handle", None)
        if handle is not None:
            handle._clear_cache()  # the parameters changed: their cached casts are stale
        return result

    optimizer.step = types.MethodType(step_without_casts, optimizer)


def _initialize(models, optimizers, properties, num_losses, cast_model_outputs, hysteresis):
    optimizers_was_list = False
    if is_optimizer(optimizers):
        optimizers = [optimizers]
    elif optimizers is None:
        optimizers = []
    elif isinstance(optimizers, list):
        optimizers_was_list = True
        _check_optimizers(optimizers)
    else:
        _check_optimizers([optimizers])
        raise TypeError("optimizers must be either a single optimizer or a list of optimizers.")

    if isinstance(models, torch.nn.Module):
        models_was_list = False
        models = [models]
    elif isinstance(models, list):
        models_was_list = True
    else:
        raise TypeError("models must be either a single model or a list of models.")

    _check_models(models)
    if not _amp_state.allow_incoming_model_not_fp32:
        _check_params_fp32(models)
    if num_losses < 1:
        raise ValueError(f"num_losses must be at least 1, got {num_losses}")

    cast_type = properties.cast_model_type or None
    for model in models:
        if cast_type is not None:
            if properties.keep_batchnorm_fp32:
                convert_network(model, cast_type)
            else:
                model.to(cast_type)
            output_dtype = cast_model_outputs if cast_model_outputs is not None else torch.float32
            casting.ModelCasts(input_dtype=cast_type, output_dtype=output_dtype).attach(model)
        elif cast_model_outputs is not None:
            casting.ModelCasts(None, cast_model_outputs).attach(model)
        else:
            casting.detach_from(model)  # an earlier initialize's casts
        attach_model_hooks(model, cast_type)

    for i, optimizer in enumerate(optimizers):
        optimizers[i] = process_optimizer(optimizer, properties)

    _amp_state.loss_scalers = [
        LossScaler(
            properties.loss_scale,
            min_loss_scale=_amp_state.min_loss_scale,
            max_loss_scale=_amp_state.max_loss_scale,
            hysteresis=hysteresis,
        )
        for _ in range(num_losses)
    ]
    if properties.patch_torch_functions:
        # O1: upstream's function casts for the whole process (amp.init); each optimizer steps
        # without them, and its step ends the iteration of the cast cache.
        half = properties.autocast_dtype or torch.float16
        amp_init(loss_scale=properties.loss_scale, verbose=_amp_state.verbosity == 2, dtype=half)
        for optimizer in optimizers:
            _step_without_casts(optimizer)

    if optimizers_was_list:
        return (models if models_was_list else models[0]), optimizers
    if len(optimizers) == 0:
        return models if models_was_list else models[0]
    return (models if models_was_list else models[0]), optimizers[0]
