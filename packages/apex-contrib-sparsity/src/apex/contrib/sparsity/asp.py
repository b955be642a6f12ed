"""ASP, automatic sparsity: masks eligible weights N:M and keeps them so through training.

Upstream's ``apex.contrib.sparsity.asp`` API: the class ``ASP`` whose classmethods hold one global
state (one model, one optimizer per process), and ``eligible_modules``.

Differences from upstream, on purpose (each also said where it applies):

- Mask and pruned-weight buffers are looked up on their module at each use, so ``model.to(...)``
  after ``init_model_for_pruning`` (which replaces buffer tensors) keeps working; upstream holds
  the tensors it registered and silently stops updating the model's buffers.
- ``compute_sparse_masks`` restores the dense weights (when masks are already computed) *before*
  the channel permutation, so the stowed pruned values are added back to the channels they came
  from; upstream permutes first. With an optimizer registered, its per-parameter state tensors
  (momentum, Adam moments) are permuted with their parameters (upstream leaves them unpermuted).
- The weight-shape eligibility rule (rows a multiple of 8, columns of 16) applies to every dtype
  (upstream checks only float32 and float16 weights) and skips weights of fewer than 2 dimensions.
- Module types are matched through their class hierarchy (a subclass of ``nn.Linear`` is pruned
  as a Linear); upstream looks the exact type up and raises KeyError for subclasses.
- A bad pattern name raises ValueError in ``init_model_for_pruning`` (upstream fails later);
  ``already_init_asp_model`` always returns a bool (upstream returns None below verbosity 3);
  ``is_sparsity_enabled`` counts a mask as sparse when any element is pruned (upstream requires
  exactly half, which only fits N:M patterns of density 1/2).
- Upstream's asserts are raised as AssertionError with upstream's messages (they do not vanish
  under ``python -O``). The ``whitelist`` and ``custom_layer_dict`` arguments are not mutated.
- ``_reset_state()`` (ours, private) forgets the global state, for tests and notebooks.
"""

from __future__ import annotations

import os
import time
import types
from typing import ClassVar

import torch

from apex.contrib.sparsity.permutation_lib import Permutation
from apex.contrib.sparsity.sparse_masklib import create_mask, parse_pattern


def eligible_modules(model, whitelist_layer_types, allowed_layer_names, disallowed_layer_names):
    """``(name, module)`` of the modules of ``model`` that are instances of the whitelisted
    types, named in ``allowed_layer_names`` (when not None) and not in ``disallowed_layer_names``."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, whitelist_layer_types) and name not in disallowed_layer_names:
            if allowed_layer_names is not None and name not in allowed_layer_names:
                continue
            found.append((name, module))
    return found


def default_sparse_parameter_list() -> dict:
    """Which parameters of which module types ASP knows how to prune."""
    return {
        torch.nn.Linear: ["weight"],
        torch.nn.Conv1d: ["weight"],
        torch.nn.Conv2d: ["weight"],
        torch.nn.Conv3d: ["weight"],
        torch.nn.modules.linear.NonDynamicallyQuantizableLinear: ["weight"],
        torch.nn.MultiheadAttention: ["q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_weight"],
    }


def _lookup(table: dict, module_type: type):
    for klass in module_type.__mro__:
        if klass in table:
            return table[klass]
    return None


def _unwrapped(model):
    """The module inside a (torch or apex) DistributedDataParallel or DataParallel wrapper."""
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    if isinstance(model, wrappers) or type(model).__name__ == "DistributedDataParallel":
        return model.module
    return model


class _SparseParameter:
    """One pruned parameter: where it lives, and its buffers fetched from the module at each use."""

    def __init__(self, module_name: str, module: torch.nn.Module, p_name: str):
        self.module_name, self.module, self.p_name = module_name, module, p_name
        buffer = p_name.split(".")[-1]  # buffer names cannot contain "."
        self.mask_name = f"__{buffer}_mma_mask"
        self.pruned_name = f"__{buffer}_mma_pruned_p"

    @property
    def p(self) -> torch.nn.Parameter:
        return getattr(self.module, self.p_name)

    @property
    def mask(self) -> torch.Tensor:
        return self.module._buffers[self.mask_name]

    @property
    def pruned(self) -> torch.Tensor | None:
        return self.module._buffers.get(self.pruned_name)

    def as_tuple(self) -> tuple:
        """Upstream's ``(module_name, module, p_name, p, mask, pruned)``."""
        return self.module_name, self.module, self.p_name, self.p, self.mask, self.pruned


class ASP:
    """Automatic SParsity (all classmethods; one model and one optimizer per process).

    Fresh model::

        ASP.init_model_for_pruning(model, "m4n2_1d", ...)
        ASP.init_optimizer_for_pruning(optimizer)
        ASP.compute_sparse_masks()  # prunes; sparsity is off until then

    From a checkpoint saved with sparsity on: ``init_model_for_pruning``, then
    ``model.load_state_dict(...)`` (which fills the ``__weight_mma_mask`` buffers), then
    ``init_optimizer_for_pruning``.
    """

    _model = None
    _verbosity = 0
    _optimizer = None
    _sparse_parameters: ClassVar[list[_SparseParameter]] = []
    _calculate_mask = None
    _allow_permutation = True
    _all_parameters: ClassVar[list] = []
    _save_permutation_graph = False
    _permutation_output_dir = "."

    @classmethod
    def _reset_state(cls) -> None:
        """Forget the model and optimizer (ours; upstream has no way back). The model keeps its
        buffers and the optimizer its patched step."""
        cls._model = None
        cls._verbosity = 0
        cls._optimizer = None
        cls._sparse_parameters = []
        cls._calculate_mask = None
        cls._allow_permutation = True
        cls._all_parameters = []
        cls._save_permutation_graph = False
        cls._permutation_output_dir = "."
        Permutation._reset_state()

    @classmethod
    def init_model_for_pruning(
        cls,
        model,
        mask_calculator="m4n2_1d",
        verbosity=3,
        whitelist=(torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.MultiheadAttention),
        allowed_layer_names=None,
        disallowed_layer_names=(),
        allow_recompute_mask=False,
        custom_layer_dict=None,
        allow_permutation=True,
    ):
        """Add mask buffers to the eligible weights of ``model`` (sparsity stays off until
        :meth:`compute_sparse_masks`).

        Args:
            model: the module to prune (a DistributedDataParallel wrapper is fine).
            mask_calculator: a pattern name for :func:`create_mask` (``"m4n2_1d"``, ...), or a
                callable taking a weight and returning its mask (same shape; nonzero = kept).
            verbosity: 0 errors only, 1 and warnings, 2 and info, 3 and debug (printed).
            whitelist: module types to prune (each must be one ASP knows, or in
                ``custom_layer_dict``).
            allowed_layer_names: if not None, only modules of these names are pruned.
            disallowed_layer_names: modules of these names are not pruned.
            allow_recompute_mask: keep the pruned values (in CPU memory, buffers
                ``__<name>_mma_pruned_p``) so :meth:`restore_pruned_weights` and recomputing
                masks can restore the dense weights.
            custom_layer_dict: more module types and the names of their parameters to prune,
                e.g. ``{MyLinear: ["weight"]}``.
            allow_permutation: search and apply an input-channel permutation (see
                :class:`~apex.contrib.sparsity.permutation_lib.Permutation`) before computing
                masks, so that pruning keeps more magnitude.

        A weight is eligible when it requires grad, has at least 2 dimensions, and its first
        dimension is a multiple of 8 and its second of 16 (the sparse tensor-core shapes; the
        others are skipped with a message). Each gets a bool buffer ``__<name>_mma_mask``, all
        ones until masks are computed. Raises AssertionError when ASP is initialized already.
        """
        if cls._model is not None:
            raise AssertionError("ASP has been initialized already.")
        if isinstance(mask_calculator, str):
            parse_pattern(mask_calculator)  # an unknown name raises here, listing the valid ones
            pattern = mask_calculator

            def calculate_mask(param):
                return create_mask(param, pattern).bool()

        elif callable(mask_calculator):
            calculate_mask = mask_calculator
        else:
            raise TypeError(
                f"ASP.init_model_for_pruning: mask_calculator must be a pattern name or a callable, got "
                f"{type(mask_calculator).__name__}"
            )

        sparse_parameter_list = default_sparse_parameter_list()
        whitelist = list(whitelist)
        if custom_layer_dict:
            sparse_parameter_list.update(custom_layer_dict)
            whitelist += list(custom_layer_dict.keys())
        for module_type in whitelist:
            if _lookup(sparse_parameter_list, module_type) is None:
                raise AssertionError(f"Module {module_type} :: Don't know how to sparsify module.")

        cls._model = model
        cls._verbosity = verbosity
        cls._calculate_mask = calculate_mask
        cls._allow_permutation = allow_permutation
        cls._sparse_parameters = []
        cls._all_parameters = []

        disallowed = set(disallowed_layer_names or ())
        for module_name, module in eligible_modules(model, tuple(whitelist), allowed_layer_names, disallowed):
            names = _lookup(sparse_parameter_list, type(module))
            for p_name, p in module.named_parameters(recurse=False):
                if p_name not in names or not p.requires_grad:
                    if verbosity >= 3:
                        print(f"[ASP] Not sparsifying {module_name}::{p_name} of size={p.size()} and type={p.dtype}")
                    continue
                if p.dim() < 2 or p.shape[0] % 8 or p.shape[1] % 16:
                    if verbosity >= 1:
                        print(
                            f"[ASP] Auto skipping pruning {module_name}::{p_name} of size={p.size()} and "
                            f"type={p.dtype} for sparsity"
                        )
                    continue
                if verbosity >= 3:
                    print(
                        f"[ASP] Sparsifying {module_name}::{p_name} of size={p.size()} and type={p.dtype} for sparsity"
                    )
                entry = _SparseParameter(module_name, module, p_name)
                module.register_buffer(entry.mask_name, torch.ones_like(p, dtype=torch.bool))
                if allow_recompute_mask:
                    module.register_buffer(entry.pruned_name, torch.zeros_like(p, device="cpu"))
                cls._sparse_parameters.append(entry)

        if allow_permutation:
            for module_name, module in model.named_modules():
                for p_name, p in module.named_parameters(recurse=False):
                    cls._all_parameters.append((module_name, module, p_name, p))
            cls._permutation_output_dir = "."
            Permutation.set_permutation_params_from_asp(
                cls._model, [e.as_tuple() for e in cls._sparse_parameters], cls._all_parameters, verbosity
            )
            Permutation.set_identical_seed()

    @classmethod
    def already_init_asp_model(cls) -> bool:
        """Whether :meth:`init_model_for_pruning` has been called."""
        initialized = cls._model is not None
        if cls._verbosity >= 3:
            print("[ASP] ASP has been initialized already." if initialized else "[ASP] ASP has not been initialized.")
        return initialized

    @classmethod
    def init_optimizer_for_pruning(cls, optimizer):
        """Patch ``optimizer.step`` to mask the gradients before, and the weights after, each step.

        Call after :meth:`init_model_for_pruning`; raises AssertionError otherwise, or when an
        optimizer is registered already.
        """
        if cls._optimizer is not None:
            raise AssertionError("ASP has initialized optimizer already.")
        if cls._calculate_mask is None:
            raise AssertionError("Called ASP.init_optimizer_for_pruning before ASP.init_model_for_pruning.")
        cls._optimizer = optimizer
        original_step = optimizer.step

        def step(opt_self, *args, **kwargs):
            with torch.no_grad():
                for entry in cls._sparse_parameters:
                    p = entry.p
                    if p.grad is not None:
                        p.grad.mul_(entry.mask)
            result = original_step(*args, **kwargs)
            with torch.no_grad():
                for entry in cls._sparse_parameters:
                    entry.p.mul_(entry.mask)
            return result

        optimizer.step = types.MethodType(step, optimizer)

    @classmethod
    def _mask_of(cls, entry: _SparseParameter, p: torch.Tensor) -> torch.Tensor:
        mask = cls._calculate_mask(p)
        if not isinstance(mask, torch.Tensor) or mask.shape != p.shape:
            got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(
                f"ASP: the mask calculator returned {got} for {entry.module_name}::{entry.p_name} of shape "
                f"{tuple(p.shape)}; expected a tensor of that shape"
            )
        return mask.to(device=p.device, dtype=torch.bool)

    @classmethod
    def compute_sparse_masks(cls):
        """Compute the masks (after the channel permutation, when allowed) and prune the weights.

        Recomputing masks when they are computed already needs ``allow_recompute_mask=True``
        (the dense weights are restored first); AssertionError otherwise.
        """
        with torch.no_grad():
            for entry in cls._sparse_parameters:
                mask, pruned = entry.mask, entry.pruned
                if not bool(mask.all()):
                    if pruned is None:
                        raise AssertionError("Unable to restore dense parameter because allow_recompute_mask == False")
                    entry.p.add_(pruned.to(entry.p.device))
                    mask.fill_(True)
                    pruned.zero_()

            if cls._allow_permutation:
                model = _unwrapped(cls._model)
                start = time.perf_counter()
                permuted = Permutation.permute_model(
                    model,
                    dump_fx_graph=cls._save_permutation_graph,
                    save_dumped_fx_graph=os.path.join(cls._permutation_output_dir, "model_permutation_graph.json"),
                    optimizer=cls._optimizer,
                )
                if cls._verbosity >= 2:
                    outcome = "applied" if permuted else "not applied"
                    print(f"[ASP] channel permutation {outcome} ({time.perf_counter() - start:.2f} s)")

            for entry in cls._sparse_parameters:
                p, mask, pruned = entry.p, entry.mask, entry.pruned
                mask.copy_(cls._mask_of(entry, p))
                if pruned is not None:
                    pruned.copy_((p * ~mask).cpu())
                p.mul_(mask)
                if cls._verbosity >= 2:
                    density = float(mask.sum()) / mask.numel()
                    print(
                        f"[ASP] Enabled {100.0 - 100.0 * density:.2f}% sparsity for "
                        f"{entry.module_name}::{entry.p_name} "
                        f"of size={p.size()} and type={p.dtype}"
                    )

    @classmethod
    def restore_pruned_weights(cls):
        """Turn sparsity off: add the stowed pruned values back and reset the masks to ones.

        Needs ``allow_recompute_mask=True`` when any mask is sparse; AssertionError otherwise.
        """
        with torch.no_grad():
            for entry in cls._sparse_parameters:
                mask, pruned = entry.mask, entry.pruned
                if not bool(mask.all()):
                    if pruned is None:
                        raise AssertionError("Unable to restore dense parameter because allow_recompute_mask == False")
                    entry.p.add_(pruned.to(entry.p.device))
                    mask.fill_(True)
                    pruned.zero_()
                    if cls._verbosity >= 2:
                        print(
                            f"[ASP] Disabled sparsity for {entry.module_name}::{entry.p_name} (dense weights restored)"
                        )

    @classmethod
    def is_sparsity_enabled(cls) -> bool:
        """Whether the masks are computed (e.g. after loading a checkpoint): False when every mask
        is all ones, True when every mask prunes something; AssertionError("Inconsistent model
        sparsity") when some do and some do not."""
        full = [bool(entry.mask.all()) for entry in cls._sparse_parameters]
        if all(full):
            return False
        if not any(full):
            return True
        raise AssertionError("Inconsistent model sparsity")

    @classmethod
    def prune_trained_model(cls, model, optimizer):
        """Prune a trained model 2:4 in one call: init_model_for_pruning (m4n2_1d, Linear and
        Conv2d), init_optimizer_for_pruning, compute_sparse_masks."""
        cls.init_model_for_pruning(
            model,
            mask_calculator="m4n2_1d",
            verbosity=2,
            whitelist=[torch.nn.Linear, torch.nn.Conv2d],
            allow_recompute_mask=False,
        )
        cls.init_optimizer_for_pruning(optimizer)
        cls.compute_sparse_masks()

    @classmethod
    def set_permutation_saving_params(
        cls, allow_permutation=True, save_permutation_graph=False, permutation_output_dir="."
    ):
        """Whether to permute channels, and whether and where to save the permutation graph (JSON)."""
        if cls._verbosity >= 2:
            print(
                f"[ASP] allow permutation: {allow_permutation}, save permutation graph: {save_permutation_graph}, "
                f"output dir: {permutation_output_dir}"
            )
        cls._allow_permutation = allow_permutation
        cls._save_permutation_graph = save_permutation_graph
        cls._permutation_output_dir = permutation_output_dir
        Permutation.set_permutation_saving_params(allow_permutation, save_permutation_graph, permutation_output_dir)


__all__ = ["ASP", "eligible_modules"]
