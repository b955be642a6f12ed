"""``DistributedFusedLAMB``: LAMB with the optimizer state sharded over the ranks (upstream's MLPerf-BERT-era
contrib optimizer)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from apex.contrib.optimizers import _ops

# all_gather_single / reduce_scatter_single supersede the *_tensor forms where they exist.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_MODEL_DTYPES = (torch.float32, torch.float16)


class DistributedFusedLAMB(torch.optim.Optimizer):
    r"""LAMB over data-parallel ranks with ZeRO-style sharded state, as upstream's
    ``apex.contrib.optimizers.distributed_fused_lamb.DistributedFusedLAMB``.

    The parameters that require grad are laid end to end in one flat buffer, padded to a multiple of
    the world size; rank ``r`` owns the ``r``-th equal shard and keeps, for it only, fp32 master
    weights and the two moments. A step:

    1. the gradients (``.grad``, accumulated over any number of backward passes) are copied into a
       flat buffer, divided by the world size and reduce-scattered (sum), so each rank holds the
       averaged gradients of its shard (still multiplied by the loss scale ``global_scale``);
    2. the global L2 norm of the averaged, scaled gradients is one all-reduce of the shards' squared
       norms; when it is not finite the step is skipped on every rank (no state changes, the step
       counter does not advance);
    3. per parameter fragment of the shard, LAMB's update term (``distributed_lamb_cuda``'s first
       stage): gradients divided by ``global_scale`` and, when ``max_grad_norm > 0``, by
       ``max(1, (norm/scale + 1e-6) / max_grad_norm)``; Adam moments; ``u = m^/(sqrt(v^)+eps)``
       plus the decoupled decay (``adam_w_mode``) or with L2 decay on the gradient;
    4. the per-parameter norms of the masters and of ``u`` (fragments' squared norms, all-reduced),
       the trust ratio ``||p|| / ||u||`` for parameters with weight decay (all with ``use_nvlamb``),
       ``p -= lr * ratio * u`` on the masters, rounded into this rank's shard of the flat parameter
       buffer;
    5. the flat parameter buffer is all-gathered and copied into the model's parameters.

    Usage as upstream: ``set_global_scale(loss_scale)`` (default 1), backward, then ``step()``
    (``complete_reductions()`` may be called first, as upstream's training loops do; ``step`` calls
    it otherwise). With ``torch.amp.GradScaler``, ``scaler.step(optimizer)`` passes itself as
    ``grad_scaler``: the loss scale is then taken from it when none was set, and the overflow is
    reported to it (``found_inf``), as upstream.

    Args (upstream's, in its order):
        params: parameters or parameter groups (fp32 or fp16; all on one device).
        lr, bias_correction, grad_averaging, betas, eps, weight_decay, max_grad_norm, adam_w_mode,
        use_nvlamb: LAMB's hyperparameters, as :class:`apex.optimizers.FusedLAMB`'s (per group, except
            ``max_grad_norm``, which is global, from the defaults).
        step_supports_amp_scaling: expose ``_step_supports_amp_scaling`` to ``torch.amp.GradScaler``.
        overlap_reductions, dwu_num_blocks, dwu_num_chunks, dwu_num_rs_pg, dwu_num_ar_pg,
        dwu_num_ag_pg, fused_norm, full_ar, fuse_scale, nccl_allgather_channels: scheduling only.
            Upstream pipelines the reductions per block and chunk over several process groups and
            streams during backward; here there is one schedule (one reduce-scatter after backward, one
            all-gather after the update), which gives the same values, so these are accepted and
            change nothing (``dwu_num_blocks``/``dwu_num_chunks`` must still be positive).
        dwu_group_size: 0 or the world size (one reduction group, as on one node). Upstream's
            hierarchical reduction (groups of ``dwu_group_size`` ranks, all-reduce across groups)
            raises NotImplementedError.
        e5m2_allgather: all-gather parameters as e5m2 bytes; not implemented, True raises.
        verbose: print the buffer layout.
        clip_after_ar: clip with the norm of the reduced gradients (upstream's default); False
            (clip each rank's gradients before the reduction) raises NotImplementedError.
        set_param_views_to_flat_buffer: make the model's parameters views into the flat parameter
            buffer, which the all-gather then writes directly.
        skip_allgather: not implemented, True raises.
        param_order: a dict parameter -> position in the flat buffer (default: group order).

    Upstream's training loops work unchanged: ``_lazy_init_stage1()`` before backward (nothing to do
    here), ``_lazy_init_stage2()`` after it, ``optimizer._lr = lr`` (one learning rate for all
    parameters, a float or a device tensor; while it is None, as by default here, each group's ``lr``
    is used), ``zero_grad()`` before or after ``complete_reductions()``, ``set_global_scale``,
    ``grad_scaler.step(optimizer)``.

    Differences from upstream, on purpose: the gradient and parameter buffers are in the model's
    dtype (fp32 for mixed fp16/fp32 models; upstream always uses fp16, which rounds fp32 parameters
    to 16 bits); ``grad_averaging=False`` is honoured (upstream's kernel ignores it); the groups' ``lr``
    is used until ``_lr`` is assigned (upstream's ``_lr`` starts at 0); ``global_scale`` defaults to 1;
    the gradients are copied into the flat buffer after backward (by ``_lazy_init_stage2``,
    ``zero_grad``, ``complete_reductions`` or ``step``, whichever comes first; a gradient hook notes
    that backward wrote them) rather than by per-block hooks during backward, and
    ``set_is_accumulation_step`` only keeps ``zero_grad`` from gathering; ``set_last_step`` records its flag.
    Runs on the CPU (gloo) and CUDA (NCCL); this package's LAMB ops have CUDA kernels (PyTorch references
    on the CPU).
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        grad_averaging=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        max_grad_norm=0.0,
        adam_w_mode=True,
        use_nvlamb=False,
        step_supports_amp_scaling=True,
        overlap_reductions=True,
        dwu_group_size=0,
        dwu_num_blocks=4,
        dwu_num_chunks=4,
        dwu_num_rs_pg=1,
        dwu_num_ar_pg=4,
        dwu_num_ag_pg=0,
        fused_norm=False,
        e5m2_allgather=False,
        verbose=False,
        clip_after_ar=True,
        full_ar=False,
        set_param_views_to_flat_buffer=False,
        skip_allgather=False,
        fuse_scale=False,
        param_order=None,
        nccl_allgather_channels=0,
    ):
        from apex.optimizers._base import check_hyperparameters

        name = "DistributedFusedLAMB"
        check_hyperparameters(name, lr, betas=betas, eps=eps, weight_decay=weight_decay, max_grad_norm=max_grad_norm)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{name} needs an initialized torch.distributed default process group")
        world = dist.get_world_size()
        if dwu_group_size not in (0, world) and dwu_group_size > 0:
            raise NotImplementedError(
                f"{name}: dwu_group_size={dwu_group_size} (hierarchical reduction over groups of ranks) is not "
                f"implemented; use 0 or the world size ({world})"
            )
        for arg, value in (("dwu_num_blocks", dwu_num_blocks), ("dwu_num_chunks", dwu_num_chunks)):
            if value < 1:
                raise ValueError(f"{name}: {arg} must be positive, got {value}")
        if e5m2_allgather:
            raise NotImplementedError(f"{name}: e5m2_allgather=True is not implemented")
        if not clip_after_ar:
            raise NotImplementedError(f"{name}: clip_after_ar=False (clipping before the reduction) is not implemented")
        if skip_allgather:
            raise NotImplementedError(f"{name}: skip_allgather=True is not implemented")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            grad_averaging=grad_averaging,
            max_grad_norm=max_grad_norm,
        )
        super().__init__(params, defaults)
        self._adam_w_mode = 1 if adam_w_mode else 0
        self._use_nvlamb = use_nvlamb
        self._step_supports_amp_scaling = step_supports_amp_scaling
        self._overlap_reductions = overlap_reductions
        self._set_flat_param_view = set_param_views_to_flat_buffer
        self._verbose = verbose
        self._is_accumulation_step = False
        self._last_step = False
        self._global_scale = None
        self._L2_grad_norm = None
        # Upstream's loops assign ``optimizer._lr`` (a float or a device tensor) each step; None: each group's lr.
        self._lr = None
        # Where the gradients are: written by backward since the last gather (_pending), copied into the
        # flat buffer (_gathered), reduce-scattered and not yet stepped on (_reduced).
        self._pending = self._gathered = self._reduced = False
        self._world_size = world
        self._rank = dist.get_rank()
        self._build(param_order)

    # layout -------------------------------------------------------------------------------------

    def _build(self, param_order) -> None:
        entries = []  # (position, param, group index)
        for group_index, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.requires_grad:
                    entries.append((len(entries), p, group_index))
        if not entries:
            raise ValueError("DistributedFusedLAMB: no parameter requires grad")
        if param_order is not None:
            missing = [i for i, (_, p, _) in enumerate(entries) if p not in param_order]
            if missing:
                raise ValueError(f"DistributedFusedLAMB: param_order has no position for parameter {missing[0]}")
            entries.sort(key=lambda e: param_order[e[1]])
        params = [p for _, p, _ in entries]
        devices = {p.device for p in params}
        dtypes = {p.dtype for p in params}
        if len(devices) != 1:
            raise ValueError(f"DistributedFusedLAMB: params must share one device, got {sorted(map(str, devices))}")
        if not dtypes <= set(_MODEL_DTYPES):
            raise TypeError(f"DistributedFusedLAMB: params must be float32 or float16, got {sorted(map(str, dtypes))}")
        self._device = devices.pop()
        self._flat_dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        self._model_params = params
        self._param_groups_of = [g for _, _, g in entries]
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        self._offsets = offsets
        self._net_total_param_size = total
        self._shard_size = -(-total // self._world_size)
        self._total_param_size = self._shard_size * self._world_size
        shard_start = self._rank * self._shard_size
        shard_end = shard_start + self._shard_size

        # Every rank starts from rank 0's parameters, as upstream.
        with torch.no_grad():
            for p in params:
                dist.broadcast(p.data, 0)
        self._new_params = torch.zeros(self._total_param_size, dtype=self._flat_dtype, device=self._device)
        for p, offset in zip(params, offsets):
            self._new_params[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
        if self._set_flat_param_view:
            if any(p.dtype != self._flat_dtype for p in params):
                raise TypeError(
                    "DistributedFusedLAMB: set_param_views_to_flat_buffer=True needs parameters of one dtype"
                )
            for p, offset in zip(params, offsets):
                p.data = self._new_params[offset : offset + p.numel()].view_as(p)
        self._fp32_p = self._new_params[shard_start:shard_end].float().clone()
        self._fp32_m = torch.zeros_like(self._fp32_p)
        self._fp32_v = torch.zeros_like(self._fp32_p)
        self._fp32_u = torch.zeros_like(self._fp32_p)
        self._flat_grads = torch.zeros(self._total_param_size, dtype=self._flat_dtype, device=self._device)
        self._shard_grads = torch.zeros(self._shard_size, dtype=self._flat_dtype, device=self._device)
        self._step = torch.zeros(1, dtype=torch.int32, device=self._device)
        self._overflow_buf = torch.zeros(1, dtype=torch.int32, device=self._device)

        # The fragments of this rank's shard: (parameter index, start in the shard, length).
        fragments = []
        for i, (p, offset) in enumerate(zip(params, offsets)):
            start, end = max(offset, shard_start), min(offset + p.numel(), shard_end)
            if start < end:
                fragments.append((i, start - shard_start, end - start))
        self._fragments = fragments
        self._fragment_param = torch.tensor([i for i, _, _ in fragments], dtype=torch.int64, device=self._device)
        self._shard_views = {
            name: [buf[s : s + n] for _, s, n in fragments]
            for name, buf in (("p", self._fp32_p), ("m", self._fp32_m), ("v", self._fp32_v), ("u", self._fp32_u))
        }
        self._shard_views["g"] = [self._shard_grads[s : s + n] for _, s, n in fragments]
        self._shard_views["p_copy"] = [self._new_params[shard_start + s : shard_start + s + n] for _, s, n in fragments]
        for p in params:
            # Backward marks the gradients as new: zero_grad() before complete_reductions() (as upstream's
            # loops may call it, its hooks having copied the gradients during backward) gathers them first.
            p.register_post_accumulate_grad_hook(self._mark_pending)
        if self._verbose:
            print(
                f"DistributedFusedLAMB rank {self._rank}: {len(params)} params, {total} elements, "
                f"shard {self._shard_size} ({len(fragments)} fragments)"
            )

    def _per_fragment(self, fn, dtype=torch.float32):
        values = [fn(self.param_groups[self._param_groups_of[i]]) for i, _, _ in self._fragments]
        return torch.tensor(values, dtype=dtype, device=self._device)

    # upstream's public methods ------------------------------------------------------------------

    def set_global_scale(self, global_scale):
        """Set the loss scale the gradients carry."""
        self._global_scale = global_scale

    @property
    def global_scale(self):
        return self._global_scale

    @property
    def L2_grad_norm(self):
        """The global L2 norm of the last step's averaged (still loss-scaled) gradients, a device tensor."""
        return self._L2_grad_norm

    def _mark_pending(self, param) -> None:
        self._pending = True

    def _lazy_init_stage1(self):
        """Upstream's first half of a lazy initialization before backward; everything is built at construction."""

    def _lazy_init_stage2(self):
        """After backward (upstream's second half of the lazy initialization): gathers the new gradients."""
        if self._pending:
            self._gather_grads()

    @torch.no_grad()
    def _gather_grads(self) -> None:
        self._flat_grads.zero_()
        for p, offset in zip(self._model_params, self._offsets):
            if p.grad is not None:
                if p.grad.is_sparse:
                    raise RuntimeError("DistributedFusedLAMB does not support sparse gradients")
                self._flat_grads[offset : offset + p.numel()].copy_(p.grad.reshape(-1))
        self._pending, self._gathered = False, True

    def set_is_accumulation_step(self, is_accumulation_step):
        self._is_accumulation_step = is_accumulation_step

    def set_last_step(self, last_step):
        self._last_step = last_step

    def zero_grad(self, set_to_none: bool = True):
        """Clears ``.grad``; gradients written by a backward since the last gather are gathered first, so a
        following ``complete_reductions()``/``step()`` still sees them (upstream's hooks had copied them)."""
        if self._pending and not self._is_accumulation_step:
            self._gather_grads()
        super().zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def complete_reductions(self):
        """Reduce-scatter the averaged gradients and compute their global norm (once per step: a second
        call before ``step`` with no backward in between does nothing)."""
        if self._reduced and not self._pending:
            return
        if self._pending or not self._gathered:  # gradients assigned directly, or new since the last gather
            self._gather_grads()
        self._gathered = False
        self._flat_grads.div_(self._world_size)
        _reduce_scatter(self._shard_grads, self._flat_grads)
        norm_sq = self._shard_grads.float().square().sum().reshape(1)
        dist.all_reduce(norm_sq)
        self._L2_grad_norm = norm_sq.sqrt()
        self._reduced = True

    def _norms(self, shard: torch.Tensor) -> torch.Tensor:
        """Per parameter, the L2 norm over all ranks of ``shard``'s fragments."""
        squares = torch.zeros(len(self._model_params), dtype=torch.float32, device=self._device)
        if self._fragments:
            parts = torch.stack([shard[s : s + n].square().sum() for _, s, n in self._fragments])
            squares.index_add_(0, self._fragment_param, parts)
        dist.all_reduce(squares)
        return squares.sqrt()

    def _scale_tensor(self, grad_scaler) -> torch.Tensor:
        scale = self._global_scale
        if scale is None:
            scale = grad_scaler._get_scale_async() if grad_scaler is not None else 1.0
        if isinstance(scale, torch.Tensor):
            return scale.detach().reshape(1).to(device=self._device, dtype=torch.float32)
        return torch.full((1,), float(scale), dtype=torch.float32, device=self._device)

    def _fragments_by_lr(self):
        """(learning rate, indices of the fragments that take it): upstream's ``_lr`` for all when assigned,
        else each group's lr."""
        if self._lr is not None:
            return [(self._lr, list(range(len(self._fragments))))]
        by_lr: dict[float, list[int]] = {}
        for k, (i, _, _) in enumerate(self._fragments):
            by_lr.setdefault(self.param_groups[self._param_groups_of[i]]["lr"], []).append(k)
        return list(by_lr.items())

    def _lr_tensor(self, lr) -> torch.Tensor:
        if isinstance(lr, torch.Tensor):
            return lr.detach().reshape(1).to(device=self._device, dtype=torch.float32)
        return torch.full((1,), float(lr), dtype=torch.float32, device=self._device)

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """One LAMB step on the gradients of all ranks (see the class docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._reduced:
            self.complete_reductions()
        self._reduced = False
        norm = self._L2_grad_norm
        finite = torch.isfinite(norm)
        self._overflow_buf.copy_((~finite).int())
        self._step.add_(finite.int())
        scale = self._scale_tensor(grad_scaler)
        views = self._shard_views
        if self._fragments:
            beta1 = self._per_fragment(lambda g: g["betas"][0])
            _ops.lamb_compute_update_term(
                self._overflow_buf,
                views["g"],
                views["p"],
                views["m"],
                views["v"],
                views["u"],
                beta1,
                self._per_fragment(lambda g: g["betas"][1]),
                self._per_fragment(lambda g: 1.0 - g["betas"][0] if g["grad_averaging"] else 1.0),
                self._per_fragment(lambda g: 1 if g["bias_correction"] else 0, torch.int32),
                self._step,
                self._per_fragment(lambda g: g["eps"]),
                self._adam_w_mode,
                self._per_fragment(lambda g: g["weight_decay"]),
                scale,
                norm,
                float(self.defaults["max_grad_norm"]),
            )
        param_norms = self._norms(self._fp32_p)
        update_norms = self._norms(self._fp32_u)
        if self._fragments:
            decay = self._per_fragment(lambda g: g["weight_decay"])
            for lr, chosen in self._fragments_by_lr():
                index = torch.tensor(chosen, dtype=torch.int64, device=self._device)
                _ops.lamb_update_weights(
                    self._overflow_buf,
                    [views["u"][k] for k in chosen],
                    [views["p"][k] for k in chosen],
                    [views["p_copy"][k] for k in chosen],
                    param_norms.index_select(0, self._fragment_param.index_select(0, index)),
                    update_norms,
                    self._fragment_param.index_select(0, index),
                    self._lr_tensor(lr),
                    decay.index_select(0, index),
                    norm,
                    self._use_nvlamb,
                )
        shard_start = self._rank * self._shard_size
        _all_gather(self._new_params, self._new_params[shard_start : shard_start + self._shard_size].clone())
        if not self._set_flat_param_view:
            for p, offset in zip(self._model_params, self._offsets):
                p.copy_(self._new_params[offset : offset + p.numel()].view_as(p))
        if grad_scaler is not None:
            state = grad_scaler._per_optimizer_states[id(self)]
            state["found_inf_per_device"][self._device] = self._overflow_buf.float()
        return loss

    # checkpoints ----------------------------------------------------------------------------------

    def state_dict(self):
        """This rank's shard: ``step``, ``fp32_p``, ``fp32_m``, ``fp32_v`` (upstream's keys)."""
        return {"step": self._step.clone(), "fp32_p": self._fp32_p.clone(), "fp32_m": self._fp32_m.clone(),
                "fp32_v": self._fp32_v.clone()}  # fmt: skip

    def load_state_dict(self, state_dict):
        """Restores what :meth:`state_dict` saved on this rank (same world size and layout)."""
        for key in ("fp32_p", "fp32_m", "fp32_v"):
            saved = state_dict[key]
            if saved.numel() != self._shard_size:
                raise ValueError(
                    f"DistributedFusedLAMB.load_state_dict: {key} has {saved.numel()} elements, this rank's shard "
                    f"{self._shard_size} (another world size or parameter layout)"
                )
            getattr(self, "_" + key).copy_(saved)
        self._step.copy_(state_dict["step"].reshape(1))
