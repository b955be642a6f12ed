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

    The ranks form groups of ``dwu_group_size`` consecutive ranks (by default one group of all). The
    parameters that require grad are laid end to end in one flat buffer, padded to a multiple of the
    group size; the rank ``r``-th in its group owns the ``r``-th equal shard and keeps, for it only, fp32
    master weights and the two moments (the same shard, with the same state, in every group). A step:

    1. the gradients (``.grad``, accumulated over any number of backward passes) are copied into a
       flat buffer, divided by the world size and reduce-scattered (sum) within the group, then (with
       several groups) the shard is all-reduced across the groups, so each rank holds the averaged
       gradients of its shard (still multiplied by the loss scale ``global_scale``);
    2. the global L2 norm of the averaged, scaled gradients is one all-reduce of the shards' squared
       norms within the group; when it is not finite the step is skipped on every rank (no state
       changes, the step counter does not advance);
    3. per parameter fragment of the shard, LAMB's update term (``distributed_lamb_cuda``'s first
       stage): gradients divided by ``global_scale`` and, when ``max_grad_norm > 0``, by
       ``max(1, (norm/scale + 1e-6) / max_grad_norm)``; Adam moments; ``u = m^/(sqrt(v^)+eps)``
       plus the decoupled decay (``adam_w_mode``) or with L2 decay on the gradient;
    4. the per-parameter norms of the masters and of ``u`` (fragments' squared norms, all-reduced within
       the group), the trust ratio ``||p|| / ||u||`` for parameters with weight decay (all with
       ``use_nvlamb``), ``p -= lr * ratio * u`` on the masters, rounded into this rank's shard of the
       parameters (the model's dtype, or e5m2 bytes with ``e5m2_allgather``);
    5. the shards are all-gathered within the group into the flat parameter buffer, which is copied
       into the model's parameters (neither with ``skip_allgather``).

    The hierarchical reduction gives the flat one's values (up to the order of the fp32 sums).

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
            streams during backward; here there is one schedule (one reduce-scatter, and all-reduce
            across groups, after backward; one all-gather after the update), which gives the same
            values, so these are accepted and change nothing (``dwu_num_blocks``/``dwu_num_chunks``
            must still be positive). ``fused_norm`` (read by upstream only with ``clip_after_ar=False``)
            computes the local norm while copying the gradients; here it is the same fp32 norm either way.
        dwu_group_size: the size of the reduction groups, which must divide the world size (a
            ValueError names it otherwise); 0 (or less) means one group of all ranks. With several
            groups (upstream's multi-node setup), the gradients are reduce-scattered within each group
            of ``dwu_group_size`` consecutive ranks and the shards all-reduced across the groups; the
            norms are summed and the parameters all-gathered within the group. The groups are made with
            ``torch.distributed.new_group`` by every rank, in one order, at construction.
        e5m2_allgather: the shards are rounded to e5m2 (uint8 codes: the high byte of the float16,
            rounded to nearest as upstream's ``fused_adam_cuda`` does), all-gathered as bytes, and the
            model's parameters receive the e5m2 values (nothing is written when the step is skipped);
            the fp32 masters keep full precision. Cannot be combined with
            ``set_param_views_to_flat_buffer`` (a ValueError says so).
        verbose: print the buffer layout.
        clip_after_ar: True (upstream's default): clip with the norm of the reduced (averaged)
            gradients, as in step 3. False: upstream's clipping before the reduction: each rank
            multiplies its own loss-scaled gradients by ``min(1, scale * max_grad_norm / (1e-6 +
            local_norm))`` (``local_norm`` their L2 norm on this rank; a NaN coefficient counts as 1),
            using the loss scale set at the time of the reduction, then they are averaged over the
            ranks, and the update term only unscales (no second clipping). ``L2_grad_norm`` is then this
            rank's local norm (it differs between ranks), and a non-finite local norm on any rank skips
            the step on all of them.
        set_param_views_to_flat_buffer: make the model's parameters views into the flat parameter
            buffer, which the all-gather then writes directly.
        skip_allgather: the step updates the masters and this rank's shard of the 16-bit (or e5m2)
            parameter copy, as usual, but neither all-gathers the shards nor writes the model's
            parameters, which keep their values (with ``set_param_views_to_flat_buffer`` too); the
            step counter, ``L2_grad_norm`` and the overflow report are as usual.
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
    ``set_is_accumulation_step`` only keeps ``zero_grad`` from gathering; ``set_last_step`` records its
    flag. The trust ratio's ``||p||`` is the norm of the fp32 masters (upstream takes the model's
    parameters: their fp16 rounding, the e5m2 values with ``e5m2_allgather``, stale values with
    ``skip_allgather``). ``dwu_group_size=0`` means the whole world (upstream: the number of visible
    GPUs), and one that does not divide the world size raises (upstream leaves ranks out). With
    ``clip_after_ar=False``: ``max_grad_norm <= 0`` disables the clipping (upstream's coefficient is
    then 0, zeroing every gradient); the local norm and the coefficient stay fp32 (upstream rounds
    them to fp16 unless ``fused_norm``, so a loss-scaled norm above 65504 becomes inf and skips the
    step; with ``fused_norm`` on a model of fp16 and fp32 parameters its norm covers only the fp32
    gradients); the coefficient is applied once (upstream without ``fuse_scale`` multiplies the whole
    buffer again for each of its ``dwu_num_blocks`` blocks and, without ``fused_norm``, recomputes the
    norm on the scaled buffer).
    With ``skip_allgather`` the model's parameters are left alone (upstream still copies its
    un-gathered parameter buffer into them: zeros until a first all-gather). Runs on the CPU (gloo)
    and CUDA (NCCL); this package's LAMB ops have CUDA kernels (PyTorch references on the CPU).
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
        group_size = world if dwu_group_size <= 0 else int(dwu_group_size)
        if world % group_size:
            raise ValueError(
                f"{name}: dwu_group_size={dwu_group_size} must divide the world size ({world}): the ranks are "
                f"split into groups of dwu_group_size consecutive ranks (0 means one group of all ranks)"
            )
        for arg, value in (("dwu_num_blocks", dwu_num_blocks), ("dwu_num_chunks", dwu_num_chunks)):
            if value < 1:
                raise ValueError(f"{name}: {arg} must be positive, got {value}")
        if e5m2_allgather and set_param_views_to_flat_buffer:
            raise ValueError(
                f"{name}: e5m2_allgather=True gathers uint8 e5m2 codes, which model parameters cannot be views of; "
                f"it cannot be combined with set_param_views_to_flat_buffer=True"
            )
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
        self._e5m2_allgather = bool(e5m2_allgather)
        self._clip_after_ar = bool(clip_after_ar)
        self._skip_ag = bool(skip_allgather)
        # Upstream reads fused_norm only when clipping before the reduction; it changes no value here.
        self._fused_norm = bool(fused_norm) and not self._clip_after_ar
        self._finite = None
        self._world_size = world
        self._rank = dist.get_rank()
        self._make_groups(group_size)
        self._build(param_order)

    # layout -------------------------------------------------------------------------------------

    def _make_groups(self, group_size: int) -> None:
        """Upstream's hierarchy: groups of ``group_size`` consecutive ranks reduce-scatter the gradients,
        all-gather the parameters and sum the norms (``_rs_pg``); the ranks holding the same shard in each
        group (rank ``r``, ``r + group_size``, ...) all-reduce it (``_ar_pg``). One group: the default."""
        world, rank = self._world_size, self._rank
        self._group_size = group_size
        self._num_groups = world // group_size
        self._rank_in_group = rank % group_size
        self._rs_pg = self._ar_pg = None
        if self._num_groups == 1:
            return
        # Every rank creates every group, in the same order (torch.distributed.new_group's rule).
        for g in range(self._num_groups):
            ranks = list(range(g * group_size, (g + 1) * group_size))
            pg = dist.new_group(ranks=ranks)
            if rank in ranks:
                self._rs_pg = pg
        for j in range(group_size):
            ranks = list(range(j, world, group_size))
            pg = dist.new_group(ranks=ranks)
            if rank in ranks:
                self._ar_pg = pg

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
        self._shard_size = -(-total // self._group_size)
        self._total_param_size = self._shard_size * self._group_size
        shard_start = self._rank_in_group * self._shard_size
        shard_end = shard_start + self._shard_size

        # Every rank starts from rank 0's parameters, as upstream.
        with torch.no_grad():
            for p in params:
                dist.broadcast(p.data, 0)
        flat = torch.zeros(self._total_param_size, dtype=self._flat_dtype, device=self._device)
        for p, offset in zip(params, offsets):
            flat[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
        self._fp32_p = flat[shard_start:shard_end].float().clone()
        # The all-gathered parameters (upstream's _new_params) and this rank's shard of them, which the step
        # writes (upstream's _fp16_p): the model's dtype, or uint8 e5m2 codes with e5m2_allgather.
        if self._e5m2_allgather:
            flat = _ops.to_e5m2(flat)
        self._new_params = flat
        self._param_shard = flat[shard_start:shard_end].clone()
        if self._set_flat_param_view:
            if any(p.dtype != self._flat_dtype for p in params):
                raise TypeError(
                    "DistributedFusedLAMB: set_param_views_to_flat_buffer=True needs parameters of one dtype"
                )
            for p, offset in zip(params, offsets):
                p.data = self._new_params[offset : offset + p.numel()].view_as(p)
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
        self._shard_views["p_copy"] = [self._param_shard[s : s + n] for _, s, n in fragments]
        for p in params:
            # Backward marks the gradients as new: zero_grad() before complete_reductions() (as upstream's
            # loops may call it, its hooks having copied the gradients during backward) gathers them first.
            p.register_post_accumulate_grad_hook(self._mark_pending)
        if self._verbose:
            print(
                f"DistributedFusedLAMB rank {self._rank}: {len(params)} params, {total} elements, "
                f"shard {self._shard_size} ({len(fragments)} fragments), {self._num_groups} group(s) of "
                f"{self._group_size} rank(s)"
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
        """The global L2 norm of the last step's averaged (still loss-scaled) gradients, a device tensor;
        with ``clip_after_ar=False``, the norm of this rank's own gradients before the reduction."""
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
        """Reduce-scatter the averaged gradients and compute their norm (once per step: a second call before
        ``step`` with no backward in between does nothing). With ``clip_after_ar=False`` each rank's
        gradients are first clipped by their own norm, using the loss scale set at this point."""
        self._reduce(None)

    def _reduce(self, grad_scaler) -> None:
        if self._reduced and not self._pending:
            return
        if self._pending or not self._gathered:  # gradients assigned directly, or new since the last gather
            self._gather_grads()
        self._gathered = False
        if self._clip_after_ar:
            self._flat_grads.div_(self._world_size)
            self._reduce_shard()
            norm_sq = self._shard_grads.float().square().sum().reshape(1)
            dist.all_reduce(norm_sq, group=self._rs_pg)  # the shards of one group cover the buffer once
            self._L2_grad_norm = norm_sq.sqrt()
            self._finite = torch.isfinite(self._L2_grad_norm)
        else:
            # Upstream's clipping before the reduction: this rank's own (loss-scaled, unreduced) gradients
            # are scaled by min(1, scale * max_grad_norm / (1e-6 + their norm)) (1 when that is NaN), then
            # averaged over the ranks. L2_grad_norm is this rank's local norm; a non-finite one on any rank
            # skips the step on all of them.
            local = torch.linalg.vector_norm(self._flat_grads, dtype=torch.float32).reshape(1)
            self._L2_grad_norm = local
            factor = torch.full((1,), 1.0 / self._world_size, dtype=torch.float32, device=self._device)
            max_grad_norm = float(self.defaults["max_grad_norm"])
            if max_grad_norm > 0:
                coeff = self._scale_tensor(grad_scaler) * max_grad_norm / (1e-6 + local)
                factor = torch.where(coeff <= 1, coeff, 1.0) / self._world_size
            self._flat_grads.mul_(factor)
            bad = (~torch.isfinite(local)).int()
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            self._finite = bad == 0
            self._reduce_shard()
        self._reduced = True

    def _reduce_shard(self) -> None:
        """The sum over all ranks of this rank's shard of the flat gradients: a reduce-scatter within the
        group, then (several groups) an all-reduce across the groups."""
        _reduce_scatter(self._shard_grads, self._flat_grads, group=self._rs_pg)
        if self._ar_pg is not None:
            dist.all_reduce(self._shard_grads, group=self._ar_pg)

    def _norms(self, shard: torch.Tensor) -> torch.Tensor:
        """Per parameter, the L2 norm over all ranks of ``shard``'s fragments."""
        squares = torch.zeros(len(self._model_params), dtype=torch.float32, device=self._device)
        if self._fragments:
            parts = torch.stack([shard[s : s + n].square().sum() for _, s, n in self._fragments])
            squares.index_add_(0, self._fragment_param, parts)
        dist.all_reduce(squares, group=self._rs_pg)
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
            self._reduce(grad_scaler)
        self._reduced = False
        norm = self._L2_grad_norm
        finite = self._finite
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
                # Clipped before the reduction: the kernel only unscales (upstream passes 0 too).
                float(self.defaults["max_grad_norm"]) if self._clip_after_ar else 0.0,
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
        if not self._skip_ag:
            _all_gather(self._new_params, self._param_shard, group=self._rs_pg)
            if not self._set_flat_param_view:
                skipped = self._overflow_buf.reshape(()) != 0
                for p, offset in zip(self._model_params, self._offsets):
                    gathered = self._new_params[offset : offset + p.numel()].view_as(p)
                    if self._e5m2_allgather:
                        # The e5m2-rounded values, unless the step was skipped (upstream's maybe_cast).
                        p.copy_(torch.where(skipped, p, _ops.from_e5m2(gathered).to(p.dtype)))
                    else:
                        p.copy_(gathered)
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
        """Restores what :meth:`state_dict` saved on this rank (same world size, dwu_group_size and layout)."""
        for key in ("fp32_p", "fp32_m", "fp32_v"):
            saved = state_dict[key]
            if saved.numel() != self._shard_size:
                raise ValueError(
                    f"DistributedFusedLAMB.load_state_dict: {key} has {saved.numel()} elements, this rank's shard "
                    f"{self._shard_size} (another world size, dwu_group_size or parameter layout)"
                )
            getattr(self, "_" + key).copy_(saved)
        self._step.copy_(state_dict["step"].reshape(1))
        # This rank's shard of the gathered parameters follows the loaded masters (a skipped next step
        # all-gathers it as it is).
        masters = self._fp32_p
        self._param_shard.copy_(_ops.to_e5m2(masters) if self._e5m2_allgather else masters.to(self._flat_dtype))
