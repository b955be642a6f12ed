"""DistributedFusedAdam: Adam/AdamW with ZeRO-2 sharding of gradients and optimizer state."""

from __future__ import annotations

import contextlib
import math
import numbers
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from apex.contrib.optimizers import _distributed_adam_ops
from apex.optimizers import _ops as _optimizer_ops  # noqa: F401  (registers apex_optimizers.fused_adam)

__all__ = ["DistributedFusedAdam"]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CHUNK_SIZE = 65536
_STATE_DICT_FORMAT = 2
# with_scaled_states: the scaled shards of a bucket, by their row in _Bucket.scales.
_SCALED = ("params_shard", "exp_avg", "exp_avg_sq")
_MASTER, _EXP_AVG, _EXP_AVG_SQ = range(3)
# torch 2.13 names the single-tensor collectives *_single and deprecates *_tensor; 2.11 has only the latter.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class _Fragment:
    """The part of one parameter that lies in one bucket."""

    param: torch.Tensor
    group_index: int
    param_range: tuple[int, int]  # in the flattened parameter
    bucket_range: tuple[int, int]  # in the bucket
    # The part in this rank's shard, or None: range in the shard, and the matching range in the parameter.
    shard_range: tuple[int, int] | None
    shard_param_range: tuple[int, int] | None


@dataclass
class _Bucket:
    """One bucket: its layout, this rank's optimizer state and its gradient/parameter buffers."""

    index: int
    fragments: list[_Fragment] = field(default_factory=list)
    params: set = field(default_factory=set)
    # Optimizer state of the local shard.
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    params_shard: torch.Tensor | None = None  # store_params: master values in `dtype`
    param_remainders: torch.Tensor | None = None  # store_param_remainders: int16 low halves
    # with_scaled_states: the shard as segments (each local fragment one, the gaps between them
    # others), each segment's slot in `scales` (the gaps: the last slot, always 0), and per local
    # fragment the factors that turn the stored master / exp_avg / exp_avg_sq back into their values.
    segment_lengths: torch.Tensor | None = None
    segment_slots: torch.Tensor | None = None
    fragment_segments: torch.Tensor | None = None
    scales: torch.Tensor | None = None  # fp32 [3, local fragments + 1]
    # Gradients: local contributions not yet reduced, the reduced shard, the collective in flight.
    local_grads: torch.Tensor | None = None
    grads_shard: torch.Tensor | None = None
    grads_ready: set = field(default_factory=set)
    grad_sync: tuple | None = None  # (work, output shard)
    param_gather: tuple | None = None  # (work, gathered bucket, gathered into the parameters)
    # The step's per-group fragment lists and shard slices, made once (see _step_bucket).
    by_group: dict | None = None
    views: dict = field(default_factory=dict)


class DistributedFusedAdam(torch.optim.Optimizer):
    r"""Adam/AdamW whose gradients and optimizer state are sharded over data-parallel ranks (ZeRO-2).

    The parameters (those that require gradients) are laid out in one flat range, each starting at a
    multiple of 128 bytes of ``grad_sync_dtype``, in reverse order of the parameter groups (the order
    in which a backward pass usually produces their gradients), and cut into fixed-size buckets of
    ``bucket_cap_mb``; each bucket is split into equal shards, one per rank of the distributed group.
    A rank keeps optimizer state (``exp_avg``, ``exp_avg_sq`` in ``dtype``, and the master values:
    ``dtype`` copies with ``store_params``, or the low 16 bits of fp32 masters of bf16 parameters with
    ``store_param_remainders``) for its shards only.

    During backward a hook on each parameter (``register_post_accumulate_grad_hook``) adds its
    gradient to its buckets' local buffers (in ``grad_sync_dtype``) and sets ``param.grad`` to None
    (that of an empty parameter too: no trainable parameter keeps a gradient in ``param.grad``);
    with ``overlap_grad_sync`` a bucket whose parameters all have their gradient is reduce-scattered
    at once (asynchronously; at most ``pipeline_size`` collectives in flight), otherwise in
    :meth:`grad_sync` or :meth:`step`. Reduced shards accumulate over several backward passes until
    :meth:`zero_grad`; :meth:`no_sync` defers the reduction (gradient accumulation). :meth:`step`
    applies Adam to the local shards and all-gathers the parameters (in ``param_sync_dtype``) back
    into the model's parameters.

    The math (upstream's kernels; ``adam_w_mode=False``: L2 regularisation ``g += wd * p``)::

        m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g * g
        p = p - lr * (m / (1 - beta1**t)) / (sqrt(v / (1 - beta2**t)) + eps)  [- lr * wd * p in AdamW mode]

    With ``dtype=torch.float32`` the step runs apex-optimizers' ``fused_adam`` op on the shards (its
    CUDA kernel on GPUs; it applies AdamW's decay as ``p * (1 - lr * wd)`` first, the same update);
    with fp16/bf16 state or parameter remainders this package's ``distributed_adam*`` ops (their CUDA
    kernels on GPUs, one pass over the shard; the PyTorch references on the CPU).

    Args: (upstream's, in upstream's order)
        params: parameters or parameter groups (fp32, fp16 or bf16, contiguous, on ``device``).
        lr, bias_correction, betas, eps, adam_w_mode, weight_decay: as ``apex.optimizers.FusedAdam``.
        amsgrad: not supported; True raises RuntimeError (as upstream).
        dtype: dtype of the optimizer state (fp32, fp16 or bf16).
        grad_sync_dtype: dtype of the gradient buckets and their reduce-scatter (default ``dtype``).
        param_sync_dtype: dtype of the parameter all-gather (default ``dtype``).
        device: where the state lives; must be the parameters' device ("cuda" means the current
            CUDA device; pass "cpu" for CPU parameters with gloo).
        process_group: the data-parallel group (default: the default group). Parameters are
            broadcast from its first rank at construction.
        distributed_process_group: the group the state is sharded over (default ``process_group``);
        redundant_process_group: the group it is replicated over (default: none). Hybrid sharding:
            ``process_group`` size must be the product of the two sizes; each reduced shard is then
            all-reduced over the redundant group.
        average_grad_sync: average (rather than sum) the gradients over ranks.
        overlap_grad_sync: reduce-scatter buckets during backward as they fill.
        overlap_param_sync: ``step`` starts the all-gathers without waiting; they are finished (and the
            parameters written) by the first forward pass of any ``nn.Module`` afterwards (a global
            forward pre-hook), or by :meth:`param_sync`, :meth:`step`, :meth:`state_dict` or
            :meth:`load_state_dict`. Upstream instead hooks each parameter's first use. Code that reads
            the parameters outside a module's forward must call :meth:`param_sync` first.
        bucket_cap_mb: bucket size in MiB (of ``grad_sync_dtype``), as upstream rounds it: the shard
            is ``bucket_cap_mb`` MiB / world size, rounded down to a multiple of 128 bytes (at least 128).
        pipeline_size: the most reduce-scatters (and, without ``overlap_param_sync``, all-gathers)
            in flight at once.
        contiguous_param_buffer: make the parameters views of one persistent buffer laid out as the
            buckets (all parameters of one dtype); with ``param_sync_dtype`` equal to that dtype the
            all-gathers write the parameters in place (no copy after them).
        contiguous_grad_buffer: keep the gradient buckets in one persistent buffer;
            :meth:`grad_buffer_view` then gives a parameter's (unreduced, local) gradient in it.
        store_params: keep master copies of the parameters in ``dtype`` (else the step starts from the
            model's parameter values).
        store_param_remainders: bf16 parameters with fp32 state: keep only the low 16 bits of the fp32
            masters (needs ``store_params=False``, ``dtype=torch.float32`` and
            ``param_sync_dtype=torch.bfloat16``, as upstream).
        with_scaled_states: keep the master values and both moments in ``dtype`` (fp16 or bf16) scaled
            per parameter fragment (the part of a parameter in one bucket), as upstream (as in FP8-LM):
            each is stored as ``value / scale`` with ``scale = max|value| / peak``, ``peak`` half of
            fp16's largest value (as upstream) or 1 for bf16 (upstream's bf16 target overflows, see
            :func:`scaled_state_peak`), so that small moments keep their precision in fp16. The step
            runs in fp32 on unscaled copies of one bucket at a time and stores the results scaled
            again with new factors. Needs ``store_params=True``, ``dtype`` fp16 or bf16 and a 16-bit
            ``param_sync_dtype``, as upstream. The state dict holds the unscaled values in fp32.
        nccl_ub: NCCL user buffers (zero-copy collectives): the contiguous gradient buffer, the reduced
            gradient shards and (with ``contiguous_param_buffer``) the parameter buffer are allocated
            from an ``apex.contrib.nccl_allocator`` pool registered with ``distributed_process_group``,
            and the reduce-scatter sums (the shard is then divided), as upstream. Needs
            ``contiguous_grad_buffer=True``, CUDA parameters, NCCL, apex-contrib-nccl-allocator and a
            PyTorch whose NCCL backend offers ``ncclMemAlloc`` (RuntimeError saying which is missing).
        capturable: keep every group's ``lr`` as a one-element fp32 tensor on ``device`` (a float is
            converted at construction; a scheduler must then update it in place, as torch's
            ``LRScheduler`` does for tensor learning rates), so that a CUDA graph that captured the
            step reads the current rate on each replay. The step itself never syncs with the host
            (the step count lives on the device and a GradScaler's skip is decided there), so it may
            be captured with or without this flag; capture the backward pass with it, since the
            reduced gradient shards are made during backward.

    Mixed precision: ``step(grad_scaler=scaler)`` (what ``torch.amp.GradScaler.step`` passes) unscales
    inside the step and skips it on the device when a gradient is inf/NaN (on any rank), without a host
    sync; ``scaler.update()`` then sees the inf. Because the gradients live in the optimizer's shards,
    ``scaler.unscale_(optimizer)`` cannot see them: call ``optimizer.unscale_grads(grad_scaler=scaler)``
    instead (before :meth:`clip_grad_norm`); a step after torch's ``scaler.unscale_`` raises. Scalers
    that hand unscaling to ``optimizer.unscale_grads`` (``_custom_amp_unscale_grads``, as NeMo's) work.

    Differences from upstream: no CUDA side streams (collectives run asynchronously through
    ``async_op=True``); parameter state is made at construction, not on the first backward (the
    parameters must be complete then); a parameter that received no gradient is stepped with a zero
    gradient, as upstream steps whole buckets; ``state["step"]`` is a one-element fp32 tensor on
    ``device`` (so that a skipped GradScaler step is not counted without a host sync; upstream: an int).
    The state dict is upstream's v2 format (see :meth:`state_dict`).
    """

    _step_supports_amp_scaling = True
    _custom_amp_unscale_grads = True

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        adam_w_mode=True,
        weight_decay=0.0,
        amsgrad=False,
        dtype=torch.float32,
        grad_sync_dtype=None,
        param_sync_dtype=None,
        device="cuda",
        process_group=None,
        distributed_process_group=None,
        redundant_process_group=None,
        average_grad_sync=True,
        overlap_grad_sync=True,
        overlap_param_sync=False,
        bucket_cap_mb=100.0,
        pipeline_size=2,
        contiguous_param_buffer=False,
        contiguous_grad_buffer=False,
        store_params=True,
        store_param_remainders=False,
        with_scaled_states=False,
        nccl_ub=False,
        capturable=False,
    ):
        name = "DistributedFusedAdam"
        if amsgrad:
            raise RuntimeError(f"{name} does not support the AMSGrad variant (amsgrad=True)")
        if nccl_ub and not contiguous_grad_buffer:
            raise RuntimeError(f"{name}: nccl_ub=True needs contiguous_grad_buffer=True (as upstream)")
        _check_number(name, "lr", lr, allow_tensor=True)
        _check_number(name, "eps", eps)
        _check_number(name, "weight_decay", weight_decay)
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"{name}: invalid betas={betas}; expected two numbers in [0, 1)")
        grad_sync_dtype = dtype if grad_sync_dtype is None else grad_sync_dtype
        param_sync_dtype = dtype if param_sync_dtype is None else param_sync_dtype
        for arg, value in (
            ("dtype", dtype),
            ("grad_sync_dtype", grad_sync_dtype),
            ("param_sync_dtype", param_sync_dtype),
        ):
            if value not in _SUPPORTED_DTYPES:
                raise ValueError(f"{name}: {arg}={value} is not supported; expected float32, float16 or bfloat16")
        if store_param_remainders:
            if store_params:
                raise RuntimeError(f"{name}: store_param_remainders=True needs store_params=False")
            if dtype != torch.float32 or param_sync_dtype != torch.bfloat16:
                raise RuntimeError(
                    f"{name}: store_param_remainders=True needs dtype=torch.float32 and "
                    f"param_sync_dtype=torch.bfloat16 (got dtype={dtype}, param_sync_dtype={param_sync_dtype})"
                )
        if with_scaled_states:
            if not store_params:
                raise RuntimeError(f"{name}: with_scaled_states=True needs store_params=True")
            if store_param_remainders:
                raise RuntimeError(f"{name}: with_scaled_states=True needs store_param_remainders=False")
            if dtype not in (torch.float16, torch.bfloat16):
                raise RuntimeError(
                    f"{name}: with_scaled_states=True needs dtype=torch.float16 or torch.bfloat16, got dtype={dtype}"
                )
            if param_sync_dtype == torch.float32:
                raise RuntimeError(
                    f"{name}: with_scaled_states=True needs a 16-bit param_sync_dtype, "
                    f"got param_sync_dtype={param_sync_dtype}"
                )
        if not (isinstance(bucket_cap_mb, numbers.Real) and bucket_cap_mb > 0 and math.isfinite(bucket_cap_mb)):
            raise ValueError(f"{name}: bucket_cap_mb must be a positive number, got {bucket_cap_mb}")
        if not (isinstance(pipeline_size, int) and pipeline_size >= 1):
            raise ValueError(f"{name}: pipeline_size must be an int >= 1, got {pipeline_size}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{name} needs an initialized torch.distributed process group")

        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = bool(adam_w_mode)
        self.dtype = dtype
        self.grad_sync_dtype = grad_sync_dtype
        self.param_sync_dtype = param_sync_dtype
        self.device = _resolve_device(name, device)
        self.average_grad_sync = bool(average_grad_sync)
        self.overlap_grad_sync = bool(overlap_grad_sync)
        self.overlap_param_sync = bool(overlap_param_sync)
        self.pipeline_size = pipeline_size
        self.contiguous_param_buffer = bool(contiguous_param_buffer)
        self.contiguous_grad_buffer = bool(contiguous_grad_buffer)
        self.store_params = bool(store_params)
        self.store_param_remainders = bool(store_param_remainders)
        self.with_scaled_states = bool(with_scaled_states)
        self.nccl_ub = bool(nccl_ub)
        self.capturable = bool(capturable)
        if self.capturable:
            for group in self.param_groups:
                group["lr"] = torch.as_tensor(group["lr"]).to(self.device, torch.float32).reshape(())

        # Process groups: state sharded over `distributed`, replicated over `redundant`.
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.distributed_process_group = (
            self.process_group if distributed_process_group is None else distributed_process_group
        )
        self.redundant_process_group = redundant_process_group
        self.process_group_size = dist.get_world_size(self.process_group)
        self.distributed_size = dist.get_world_size(self.distributed_process_group)
        self.distributed_rank = dist.get_rank(self.distributed_process_group)
        self.redundant_size = 1 if redundant_process_group is None else dist.get_world_size(redundant_process_group)
        if self.process_group_size != self.distributed_size * self.redundant_size:
            raise RuntimeError(
                f"{name}: invalid process groups: process_group has {self.process_group_size} ranks but "
                f"distributed_process_group has {self.distributed_size} and redundant_process_group "
                f"{self.redundant_size} (their product must match)"
            )
        self.process_group_root = dist.get_global_rank(self.process_group, 0)
        nccl = dist.get_backend(self.distributed_process_group) == dist.Backend.NCCL
        # With user buffers the reduce-scatter sums (as upstream) and the shard is divided after it.
        self._average_in_collective = self.average_grad_sync and self.redundant_size == 1 and nccl and not self.nccl_ub
        self._nccl_pool = None
        if self.nccl_ub:
            if not nccl or self.device.type != "cuda":
                raise RuntimeError(
                    f"{name}: nccl_ub=True needs CUDA parameters and an NCCL distributed_process_group "
                    f"(device={self.device}, backend {dist.get_backend(self.distributed_process_group)})"
                )
            try:
                from apex.contrib import nccl_allocator
            except ImportError as error:
                raise RuntimeError(f"{name}: nccl_ub=True needs apex-contrib-nccl-allocator installed") from error
            # RuntimeError saying why where PyTorch's NCCL backend offers no ncclMemAlloc allocator
            self._nccl_pool = nccl_allocator.create_nccl_mem_pool()

        # Bucket geometry (upstream's rule): shards are multiples of 128 bytes of grad_sync_dtype.
        element_size = torch.finfo(grad_sync_dtype).bits // 8
        self.alignment = 128 // element_size
        bucket_elements = 1024 * 1024 * bucket_cap_mb / element_size
        shard_size = int(bucket_elements / self.distributed_size) // self.alignment * self.alignment
        self.shard_size = max(shard_size, self.alignment)
        self.bucket_size = self.shard_size * self.distributed_size

        self._check_params(name)
        self._broadcast_params()
        self._build_buckets()
        self.state["step"] = torch.zeros(1, dtype=torch.float32, device=self.device)
        self._grad_scale = torch.ones(1, dtype=torch.float32, device=self.device)
        self._grad_norm: tuple | None = None  # (norm type, norm of the reduced gradients before scaling)
        self._unscaled = False  # unscale_grads() ran since the last step
        self._grad_sync_enabled = True
        self._grad_syncs_in_flight: list[_Bucket] = []
        self._param_gathers_in_flight: list[_Bucket] = []
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._post_accumulate_grad_hook) for p in self._ordered_params
        ] + [p.register_post_accumulate_grad_hook(_drop_grad) for p in self._empty_params]
        self._forward_hook = None
        if self.overlap_param_sync:
            self_ref = weakref.ref(self)

            def finish_param_sync(module, args):
                optimizer = self_ref()
                if optimizer is not None and optimizer._param_gathers_in_flight:
                    optimizer.param_sync()

            self._forward_hook = torch.nn.modules.module.register_module_forward_pre_hook(finish_param_sync)

    # --- construction -------------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_buckets", None) is not None:
            raise NotImplementedError(
                "DistributedFusedAdam.add_param_group: the buckets are laid out at construction; "
                "pass every parameter group to the constructor"
            )
        super().add_param_group(param_group)

    def _check_params(self, name: str) -> None:
        self._ordered_params: list[torch.Tensor] = []
        self._empty_params: list[torch.Tensor] = []  # trainable, zero elements: no range in the buckets
        self._group_of: dict[torch.Tensor, int] = {}
        seen = set()
        for g, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                where = f"param_groups[{g}]['params'][{i}]"
                if p.dtype not in _SUPPORTED_DTYPES:
                    raise TypeError(f"{name}: {where} has dtype {p.dtype}; expected float32, float16 or bfloat16")
                if p.device != self.device:
                    raise ValueError(f"{name}: {where} is on {p.device} but device={self.device}")
                if not p.is_contiguous():
                    raise ValueError(f"{name}: {where} is not contiguous")
                if self.store_param_remainders and p.dtype != torch.bfloat16:
                    raise RuntimeError(
                        f"{name}: store_param_remainders=True needs bf16 parameters; {where} is {p.dtype}"
                    )
                if p.requires_grad and p not in seen:
                    seen.add(p)
                    if p.numel() == 0:
                        self._empty_params.append(p)
                        continue
                    self._ordered_params.append(p)
                    self._group_of[p] = g
        # Reverse order: a backward pass usually produces the last parameters' gradients first.
        self._ordered_params.reverse()

    @torch.no_grad()
    def _broadcast_params(self) -> None:
        works = [
            dist.broadcast(p, src=self.process_group_root, group=self.process_group, async_op=True)
            for group in self.param_groups
            for p in group["params"]
        ]
        for work in works:
            work.wait()

    @torch.no_grad()
    def _build_buckets(self) -> None:
        self._param_range: dict[torch.Tensor, tuple[int, int]] = {}
        offset = 0
        for p in self._ordered_params:
            offset = -(-offset // self.alignment) * self.alignment
            self._param_range[p] = (offset, offset + p.numel())
            offset += p.numel()
        num_buckets = -(-offset // self.bucket_size)
        self._buckets = [_Bucket(i) for i in range(num_buckets)]
        self._param_buckets: dict[torch.Tensor, list[_Bucket]] = {p: [] for p in self._ordered_params}
        shard_start = self.distributed_rank * self.shard_size
        for p in self._ordered_params:
            start, end = self._param_range[p]
            for b in range(start // self.bucket_size, (end - 1) // self.bucket_size + 1):
                bucket = self._buckets[b]
                lo, hi = max(start, b * self.bucket_size), min(end, (b + 1) * self.bucket_size)
                in_bucket = (lo - b * self.bucket_size, hi - b * self.bucket_size)
                s_lo, s_hi = max(in_bucket[0], shard_start), min(in_bucket[1], shard_start + self.shard_size)
                local = s_lo < s_hi
                bucket.fragments.append(
                    _Fragment(
                        param=p,
                        group_index=self._group_of[p],
                        param_range=(lo - start, hi - start),
                        bucket_range=in_bucket,
                        shard_range=(s_lo - shard_start, s_hi - shard_start) if local else None,
                        shard_param_range=(s_lo + b * self.bucket_size - start, s_hi + b * self.bucket_size - start)
                        if local
                        else None,
                    )
                )
                bucket.params.add(p)
                self._param_buckets[p].append(bucket)
        self._grad_buffer = None
        self._param_buffer = None
        self._shard_grad_buffer = None  # nccl_ub: where each bucket's reduce-scatter lands first
        with self._user_buffers():
            if self.contiguous_param_buffer:
                self._make_param_buffer(num_buckets)
            if self.contiguous_grad_buffer:
                self._grad_buffer = torch.zeros(
                    num_buckets * self.bucket_size, dtype=self.grad_sync_dtype, device=self.device
                )
            if self.nccl_ub:
                self._shard_grad_buffer = torch.zeros(
                    num_buckets * self.shard_size, dtype=self.grad_sync_dtype, device=self.device
                )
        for bucket in self._buckets:
            bucket.exp_avg = torch.zeros(self.shard_size, dtype=self.dtype, device=self.device)
            bucket.exp_avg_sq = torch.zeros(self.shard_size, dtype=self.dtype, device=self.device)
            if self.with_scaled_states:
                self._make_segments(bucket)
                bucket.params_shard = torch.empty(self.shard_size, dtype=self.dtype, device=self.device)
                self._store_scaled(bucket, _MASTER, self._pack_params(bucket, torch.float32))
            elif self.store_params:
                bucket.params_shard = self._pack_params(bucket, self.dtype)
            if self.store_param_remainders:
                bucket.param_remainders = torch.zeros(self.shard_size, dtype=torch.int16, device=self.device)

    def _make_param_buffer(self, num_buckets: int) -> None:
        dtypes = {p.dtype for p in self._ordered_params}
        if len(dtypes) > 1:
            raise ValueError(
                "DistributedFusedAdam: contiguous_param_buffer=True needs parameters of one dtype, got "
                + ", ".join(sorted(str(d) for d in dtypes))
            )
        dtype = dtypes.pop() if dtypes else self.param_sync_dtype
        self._param_buffer = torch.zeros(num_buckets * self.bucket_size, dtype=dtype, device=self.device)
        for p in self._ordered_params:
            start, end = self._param_range[p]
            view = self._param_buffer[start:end].view(p.shape)
            view.copy_(p.detach())
            p.data = view

    def _user_buffers(self):
        """Allocations inside come from the NCCL pool (nccl_ub), registered again on exit; else nothing."""
        if self._nccl_pool is None:
            return contextlib.nullcontext()
        from apex.contrib import nccl_allocator

        return nccl_allocator.nccl_mem(self._nccl_pool, device=self.device, group=self.distributed_process_group)

    def _make_segments(self, bucket: _Bucket) -> None:
        lengths, slots, fragment_segments = [], [], []
        local = sorted(self._local_fragments(bucket), key=lambda f: f.shard_range)
        gap = len(local)  # the slot of the gaps: its factor stays 0
        at = 0
        for k, f in enumerate(local):
            start, end = f.shard_range
            if start > at:
                lengths.append(start - at)
                slots.append(gap)
            fragment_segments.append(len(lengths))
            lengths.append(end - start)
            slots.append(k)
            at = end
        if at < self.shard_size:
            lengths.append(self.shard_size - at)
            slots.append(gap)
        bucket.segment_lengths = torch.tensor(lengths, dtype=torch.int64, device=self.device)
        bucket.segment_slots = torch.tensor(slots, dtype=torch.int64, device=self.device)
        bucket.fragment_segments = torch.tensor(fragment_segments, dtype=torch.int64, device=self.device)
        bucket.scales = torch.zeros(len(_SCALED), gap + 1, dtype=torch.float32, device=self.device)

    def _per_element(self, bucket: _Bucket, factors: torch.Tensor) -> torch.Tensor:
        """A shard-long fp32 vector holding each local fragment's factor over its elements (0 in the gaps)."""
        return factors[bucket.segment_slots].repeat_interleave(bucket.segment_lengths, output_size=self.shard_size)

    def _unscaled_state(self, bucket: _Bucket, which: int) -> torch.Tensor:
        """The fp32 values of a scaled state shard (``which``: _MASTER, _EXP_AVG or _EXP_AVG_SQ)."""
        stored = getattr(bucket, _SCALED[which])
        return stored.float().mul_(self._per_element(bucket, bucket.scales[which]))

    def _store_scaled(self, bucket: _Bucket, which: int, values: torch.Tensor, keep=None) -> None:
        """Store fp32 ``values`` (a shard; overwritten) into the scaled state shard ``which``, with
        new factors: each fragment's largest magnitude maps to ``scaled_state_peak(dtype)``. Where
        ``keep`` (a device bool: a skipped step) is set, the stored shard and factors stay as they
        are (storing the same values again could move them by a rounding)."""
        peaks = torch.segment_reduce(values.abs(), "max", lengths=bucket.segment_lengths, unsafe=True)
        factors = bucket.scales[which]
        new = torch.zeros_like(factors)
        new[:-1] = peaks[bucket.fragment_segments] / scaled_state_peak(self.dtype)
        # a division, not a product with the inverse: the inverse of a small factor can overflow
        stored = values.div_(self._per_element(bucket, torch.where(new > 0, new, 1.0)))
        target = getattr(bucket, _SCALED[which])
        if keep is None:
            factors.copy_(new)
            target.copy_(stored)
        else:
            factors.copy_(torch.where(keep, factors, new))
            target.copy_(torch.where(keep, target, stored.to(target.dtype)))

    def _local_fragments(self, bucket: _Bucket):
        return [f for f in bucket.fragments if f.shard_range is not None]

    def _pack_params(self, bucket: _Bucket, dtype: torch.dtype) -> torch.Tensor:
        """The model's values of this rank's shard of ``bucket``, in ``dtype`` (zeros in padding)."""
        shard = torch.zeros(self.shard_size, dtype=dtype, device=self.device)
        for f in self._local_fragments(bucket):
            shard[slice(*f.shard_range)].copy_(f.param.detach().view(-1)[slice(*f.shard_param_range)])
        return shard

    # --- gradients ----------------------------------------------------------------------------

    @torch.no_grad()
    def _post_accumulate_grad_hook(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        flat = grad.detach().reshape(-1)
        for bucket in self._param_buckets[param]:
            if bucket.grad_sync is not None:  # a new contribution must not change a buffer being reduced
                self._finish_grad_sync(bucket)
            local = self._local_grads(bucket)
            for f in bucket.fragments:
                if f.param is param:
                    local[slice(*f.bucket_range)].add_(flat[slice(*f.param_range)])
            if self._grad_sync_enabled:  # under no_sync a pass does not count towards a full bucket
                bucket.grads_ready.add(param)
        param.grad = None
        if self.overlap_grad_sync and self._grad_sync_enabled:
            for bucket in self._param_buckets[param]:
                if len(bucket.grads_ready) == len(bucket.params):
                    self._start_grad_sync(bucket)

    def _local_grads(self, bucket: _Bucket) -> torch.Tensor:
        if bucket.local_grads is None:
            if self._grad_buffer is not None:
                view = self._grad_buffer[bucket.index * self.bucket_size : (bucket.index + 1) * self.bucket_size]
                bucket.local_grads = view.zero_()
            else:
                bucket.local_grads = torch.zeros(self.bucket_size, dtype=self.grad_sync_dtype, device=self.device)
        return bucket.local_grads

    def _start_grad_sync(self, bucket: _Bucket) -> None:
        if self._shard_grad_buffer is not None and bucket.grads_shard is None:
            output = self._shard_grad_buffer[bucket.index * self.shard_size : (bucket.index + 1) * self.shard_size]
        else:  # a later reduction of the same step is added to the shard
            output = torch.empty(self.shard_size, dtype=self.grad_sync_dtype, device=self.device)
        op = dist.ReduceOp.AVG if self._average_in_collective else dist.ReduceOp.SUM
        work = _reduce_scatter(output, bucket.local_grads, op=op, group=self.distributed_process_group, async_op=True)
        bucket.grad_sync = (work, output)
        bucket.grads_ready.clear()
        self._grad_syncs_in_flight.append(bucket)
        while len(self._grad_syncs_in_flight) > self.pipeline_size:
            self._finish_grad_sync(self._grad_syncs_in_flight[0])

    def _finish_grad_sync(self, bucket: _Bucket) -> None:
        work, output = bucket.grad_sync
        work.wait()
        bucket.grad_sync = None
        self._grad_syncs_in_flight.remove(bucket)
        if self.redundant_size > 1:
            dist.all_reduce(output, group=self.redundant_process_group)
        if self.average_grad_sync and not self._average_in_collective:
            output.div_(self.process_group_size)
        if bucket.grads_shard is None:
            bucket.grads_shard = output
        else:
            bucket.grads_shard.add_(output)
        bucket.local_grads = None  # the persistent buffer is zeroed when it is next used
        self._grad_norm = None

    def grad_sync(self) -> None:
        """Reduce-scatter every bucket holding unreduced gradients, and wait for all of them."""
        for bucket in self._buckets:
            if bucket.local_grads is not None and bucket.grad_sync is None:
                self._start_grad_sync(bucket)
        while self._grad_syncs_in_flight:
            self._finish_grad_sync(self._grad_syncs_in_flight[0])

    @contextlib.contextmanager
    def no_sync(self):
        """Within the context, backward passes only accumulate gradients locally (as
        ``DistributedDataParallel.no_sync``); they are reduced by a backward pass after it, by
        :meth:`grad_sync` or by :meth:`step`."""
        previous = self._grad_sync_enabled
        self._grad_sync_enabled = False
        try:
            yield
        finally:
            self._grad_sync_enabled = previous

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop all gradients (local buckets and reduced shards) and any clipping/unscaling factor.
        ``set_to_none`` is taken for torch's signature: the gradients live in the optimizer's buffers,
        which are dropped either way, and ``param.grad`` is set to None."""
        while self._grad_syncs_in_flight:
            self._finish_grad_sync(self._grad_syncs_in_flight[0])
        for bucket in self._buckets:
            bucket.local_grads = None
            bucket.grads_shard = None
            bucket.grads_ready.clear()
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None
        self._grad_scale.fill_(1.0)
        self._grad_norm = None
        self._unscaled = False

    def grad_buffer_view(self, param: torch.Tensor) -> torch.Tensor:
        """``param``'s local (not yet reduced) gradient in the contiguous gradient buffer."""
        if self._grad_buffer is None:
            raise RuntimeError("DistributedFusedAdam.grad_buffer_view needs contiguous_grad_buffer=True")
        if param not in self._param_range:
            raise ValueError("DistributedFusedAdam.grad_buffer_view: param is not optimized by this optimizer")
        start, end = self._param_range[param]
        return self._grad_buffer[start:end].view(param.shape)

    # --- norms, clipping, unscaling ----------------------------------------------------------

    def _grad_shards(self) -> list[torch.Tensor]:
        return [b.grads_shard for b in self._buckets if b.grads_shard is not None]

    def _grad_pieces(self, parameters) -> list[torch.Tensor]:
        """The reduced gradient shards (all, or the local parts of ``parameters``), as fp32."""
        if parameters is None:
            return [s.float() for s in self._grad_shards()]
        chosen = set()
        empty = {id(e) for e in self._empty_params}
        for p in parameters:
            if id(p) in empty:
                continue  # optimized, but nothing to add to the norm
            if p not in self._param_range:
                raise RuntimeError(
                    "DistributedFusedAdam.grad_norm: a tensor in parameters is not optimized by this "
                    "optimizer (or does not require grad)"
                )
            chosen.add(p)
        return [
            bucket.grads_shard[slice(*f.shard_range)].float()
            for bucket in self._buckets
            if bucket.grads_shard is not None
            for f in self._local_fragments(bucket)
            if f.param in chosen
        ]

    @torch.no_grad()
    def grad_norm(self, parameters=None, norm_type: float = 2.0, force: bool = False) -> torch.Tensor:
        """The ``norm_type``-norm of the reduced, unscaled gradients of ``parameters`` (default: all)
        as one vector, the same on every rank: a one-element fp32 tensor on ``device``. The norm of
        all gradients is cached until they change (``force`` recomputes). Upstream takes only 2."""
        norm_type = float(norm_type)
        if not (norm_type > 0):
            raise ValueError(f"DistributedFusedAdam.grad_norm: norm_type must be positive, got {norm_type}")
        self.grad_sync()
        cached = self._grad_norm
        if parameters is None and cached is not None and not force and cached[0] == norm_type:
            return cached[1] * self._grad_scale.abs()
        pieces = self._grad_pieces(parameters)
        zero = torch.zeros((), device=self.device)
        if math.isinf(norm_type):
            local = torch.stack([t.abs().amax() for t in pieces]).amax() if pieces else zero
            local = local.reshape(1).clone()
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.distributed_process_group)
            norm = local
        else:
            local = sum((t.abs().pow(norm_type).sum() for t in pieces), zero).reshape(1)
            dist.all_reduce(local, group=self.distributed_process_group)
            norm = local.pow(1.0 / norm_type)
        if parameters is None:
            self._grad_norm = (norm_type, norm)
        return norm * self._grad_scale.abs()

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float, parameters=None, norm_type: float = 2.0) -> torch.Tensor:
        """Scale all gradients by ``min(1, max_norm / (norm + 1e-6))``, the norm being that of
        ``parameters``' gradients (default: all), as ``torch.nn.utils.clip_grad_norm_`` does; the
        scaling is applied in :meth:`step`. Returns the norm before clipping."""
        norm = self.grad_norm(parameters, norm_type)
        coefficient = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)
        self._grad_scale.mul_(coefficient)
        return norm

    @torch.no_grad()
    def unscale_grads(self, inv_scale: torch.Tensor | None = None, *args, grad_scaler=None) -> dict:
        """Multiply the gradients by ``inv_scale``: upstream's hook for gradient scalers that
        override ``_unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)`` to call
        ``optimizer.unscale_grads(inv_scale, found_inf, allow_fp16)`` (NeMo's do; the extra
        arguments are not used). Returns ``{device: found_inf}``: 1.0 when any rank's gradients hold
        an inf or NaN (upstream returns zero there; both check again in :meth:`step`).

        ``grad_scaler`` (keyword): a ``torch.amp.GradScaler`` in its READY stage: the gradients are
        multiplied by the inverse of its scale and the check is recorded in it, as its own
        ``unscale_`` would. Use this instead of ``scaler.unscale_(optimizer)``, which cannot see the
        gradients (they live in the optimizer's shards). No host sync either way."""
        self.grad_sync()
        if inv_scale is not None:
            self._grad_scale.mul_(torch.as_tensor(inv_scale).to(self.device, torch.float32).reshape(1))
        state = None
        if grad_scaler is not None and grad_scaler.is_enabled():
            from torch.amp.grad_scaler import OptState

            state = grad_scaler._per_optimizer_states[id(self)]
            if state["stage"] is OptState.UNSCALED:
                raise RuntimeError("unscale_grads() has already been called on this optimizer since the last update()")
            if state["stage"] is OptState.STEPPED:
                raise RuntimeError("unscale_grads() is being called after step()")
            scale = grad_scaler._get_scale_async()
            self._grad_scale.div_(scale.to(self.device, torch.float32).reshape(1))
        self._unscaled = True
        found = {self.device: self._found_inf()}
        if state is not None:
            state["found_inf_per_device"] = found
            state["stage"] = OptState.UNSCALED
        return found

    def _found_inf(self) -> torch.Tensor:
        """1.0 when any rank's reduced gradient (or the pending unscale/clip factor) holds an inf or
        NaN, else 0.0 (fp32, on ``device``)."""
        peaks = [s.float().abs().amax() for s in self._grad_shards()] + [self._grad_scale.abs().reshape(())]
        found = (~torch.isfinite(torch.stack(peaks).amax())).float().reshape(1)
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.process_group)
        return found

    # --- step ---------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None, *, grad_scaler=None):
        """Reduce the remaining gradients, step the local shards, and all-gather the parameters
        (or start that, with ``overlap_param_sync``). ``grad_scaler``: see the class docstring."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.param_sync()
        self.grad_sync()
        found_inf = None
        if grad_scaler is not None and grad_scaler.is_enabled():
            from torch.amp.grad_scaler import OptState

            state = grad_scaler._per_optimizer_states[id(self)]
            if state["stage"] is OptState.READY:
                found_inf = self.unscale_grads(grad_scaler=grad_scaler)[self.device]
            elif not self._unscaled:
                raise RuntimeError(
                    "DistributedFusedAdam: GradScaler.unscale_(optimizer) cannot see this optimizer's "
                    "gradients (they live in its shards, not in param.grad); call "
                    "optimizer.unscale_grads(grad_scaler=scaler) instead"
                )
            else:
                # checked again after any clipping, over every rank; the scaler's update() reads it
                found_inf = self._found_inf()
                state["found_inf_per_device"] = {self.device: found_inf}
        self._unscaled = False
        step = self.state["step"]
        if found_inf is None:
            step.add_(1.0)
        else:
            step.add_(1.0 - found_inf)
        for bucket in self._buckets:
            self._step_bucket(bucket, step, found_inf)
        self._grad_scale.fill_(1.0)
        self._grad_norm = None
        for bucket in self._buckets:
            self._start_param_gather(bucket)
        if not self.overlap_param_sync:
            self.param_sync()
        return loss

    def _step_bucket(self, bucket: _Bucket, step: torch.Tensor, found_inf: torch.Tensor | None) -> None:
        if bucket.grads_shard is None:
            grads = torch.zeros(self.shard_size, dtype=torch.float32, device=self.device)
        else:
            # Unscaled/clipped in fp32 (in place for an fp32 shard): a loss scale's inverse can be
            # subnormal in fp16.
            grads = bucket.grads_shard.float().mul_(self._grad_scale)
        exp_avg, exp_avg_sq = bucket.exp_avg, bucket.exp_avg_sq
        if self.with_scaled_states:
            # fp32 copies of this bucket's state, stepped and then stored scaled again
            master = self._unscaled_state(bucket, _MASTER)
            exp_avg, exp_avg_sq = self._unscaled_state(bucket, _EXP_AVG), self._unscaled_state(bucket, _EXP_AVG_SQ)
        elif self.store_param_remainders:
            master = self._pack_params(bucket, torch.bfloat16)
        elif self.store_params:
            master = bucket.params_shard
        else:
            master = self._pack_params(bucket, self.dtype)
        fp32_math = master.dtype == torch.float32 and not self.store_param_remainders
        separate_output = self.store_param_remainders or self.param_sync_dtype != master.dtype or not fp32_math
        # Starts from the current values: a step skipped on the device (found_inf) leaves it as it is,
        # and it is all-gathered into the parameters all the same.
        output = master.to(self.param_sync_dtype, copy=True) if separate_output else master
        bucket.param_gather = (None, output)
        if bucket.by_group is None:
            bucket.by_group = {}
            for f in self._local_fragments(bucket):
                bucket.by_group.setdefault(f.group_index, []).append(f)
        by_group = bucket.by_group
        noop = None
        for g, group_fragments in by_group.items():
            group = self.param_groups[g]
            beta1, beta2 = group["betas"]
            lr = group["lr"]
            lr_value, lr_tensor = (
                (0.0, lr.to(self.device, torch.float32).reshape(1))
                if isinstance(lr, torch.Tensor)
                else (float(lr), None)
            )

            def views(t, role, fs=group_fragments, g=g):
                # The slices of shard t per fragment, kept per (group, role) while t is the same tensor:
                # the state and (fp32) gradient shards persist from step to step, and slicing every
                # fragment for five lists each step cost 1.7 ms of host time a step for GPT's 289
                # parameters (2 CPU cores). A role whose tensor is new each step replaces its entry.
                hit = bucket.views.get((g, role))
                if hit is not None and hit[0] is t:
                    return hit[1]
                sliced = [t[slice(*f.shard_range)] for f in fs]
                bucket.views[(g, role)] = (t, sliced)
                return sliced

            if fp32_math:
                torch.ops.apex_optimizers.fused_adam(
                    _CHUNK_SIZE, views(output, "output"), views(grads, "grads"), views(exp_avg, "m"),
                    views(exp_avg_sq, "v"), views(master, "master") if separate_output else [], lr_value, 0,
                    beta1, beta2, group["eps"],
                    group["weight_decay"], self.adam_w_mode, group["bias_correction"], lr_tensor, step, None, found_inf,
                )  # fmt: skip
                continue
            if noop is None:
                noop = (
                    torch.zeros(1, dtype=torch.int32, device=self.device)
                    if found_inf is None
                    else (found_inf != 0).to(torch.int32)
                )
            one = torch.ones(1, dtype=torch.float32, device=self.device)
            mode = 1 if self.adam_w_mode else 0
            if self.store_param_remainders:
                torch.ops.apex_contrib_optimizers.distributed_adam_with_param_remainders(
                    _CHUNK_SIZE, noop, views(master, "master"), views(bucket.param_remainders, "remainders"),
                    views(bucket.exp_avg, "m"), views(bucket.exp_avg_sq, "v"), views(grads, "grads"),
                    views(output, "output"), one, lr_value, beta1, beta2,
                    group["eps"], 0, mode, group["bias_correction"], group["weight_decay"], lr_tensor, step,
                )  # fmt: skip
            else:
                torch.ops.apex_contrib_optimizers.distributed_adam(
                    _CHUNK_SIZE, noop, views(master, "master"), views(bucket.exp_avg, "m"),
                    views(bucket.exp_avg_sq, "v"), views(grads, "grads"), views(output, "output"), one, lr_value,
                    beta1, beta2, group["eps"], 0, mode, group["bias_correction"],
                    group["weight_decay"], lr_tensor, step,
                )  # fmt: skip
        if self.with_scaled_states:
            keep = None if found_inf is None else found_inf != 0
            if keep is not None:
                # a skipped step leaves the parameters as they are: the output is gathered into them,
                # and the stored master read back may differ from them by a rounding
                output.copy_(torch.where(keep, self._pack_params(bucket, output.dtype), output))
            for which, values in ((_MASTER, master), (_EXP_AVG, exp_avg), (_EXP_AVG_SQ, exp_avg_sq)):
                self._store_scaled(bucket, which, values, keep)

    # --- parameter all-gather ------------------------------------------------------------------

    def _start_param_gather(self, bucket: _Bucket) -> None:
        _, shard = bucket.param_gather
        buffer = self._param_buffer
        in_place = buffer is not None and buffer.dtype == self.param_sync_dtype
        if in_place:  # straight into the parameters
            gathered = buffer[bucket.index * self.bucket_size : (bucket.index + 1) * self.bucket_size]
        if self.distributed_size == 1:  # the shard is the whole bucket: nothing to gather
            work = None
            gathered = gathered.copy_(shard) if in_place else shard
        else:
            if not in_place:
                gathered = torch.empty(self.bucket_size, dtype=self.param_sync_dtype, device=self.device)
            work = _all_gather(gathered, shard, group=self.distributed_process_group, async_op=True)
        bucket.param_gather = (work, gathered, in_place)
        self._param_gathers_in_flight.append(bucket)
        while len(self._param_gathers_in_flight) > self.pipeline_size and not self.overlap_param_sync:
            self._finish_param_gather(self._param_gathers_in_flight[0])

    @torch.no_grad()
    def _finish_param_gather(self, bucket: _Bucket) -> None:
        work, gathered, in_place = bucket.param_gather
        if work is not None:
            work.wait()
        bucket.param_gather = None
        self._param_gathers_in_flight.remove(bucket)
        if in_place or not bucket.fragments:
            return
        # One multi-tensor copy for the bucket's parameters (GPT's 289 in ~14 buckets: a launch per
        # parameter before).
        targets = [f.param.detach().view(-1)[slice(*f.param_range)] for f in bucket.fragments]
        torch._foreach_copy_(targets, [gathered[slice(*f.bucket_range)] for f in bucket.fragments])

    def param_sync(self) -> None:
        """Finish the parameter all-gathers in flight and write the model's parameters."""
        while self._param_gathers_in_flight:
            self._finish_param_gather(self._param_gathers_in_flight[0])

    def init_params(self, params=None, param_sync_dtype=None) -> None:
        """Upstream initializes parameter state lazily, and this forces it; here the state is made
        at construction, so there is nothing left to do (kept for code that calls it)."""
        if param_sync_dtype is not None and param_sync_dtype != self.param_sync_dtype:
            raise NotImplementedError(
                "DistributedFusedAdam.init_params: a per-parameter param_sync_dtype is not supported "
                f"(the optimizer's is {self.param_sync_dtype})"
            )

    def init_param_buffer(self) -> None:
        """Upstream makes the contiguous parameter buffer here; it is made at construction."""
        if not self.contiguous_param_buffer:
            raise RuntimeError("DistributedFusedAdam.init_param_buffer needs contiguous_param_buffer=True")

    # --- state dict ------------------------------------------------------------------------------

    def _gather_shards(self, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per bucket, the whole bucket gathered from the shards of the distributed group."""
        outputs = []
        works = []
        for shard in shards:
            out = torch.empty(self.bucket_size, dtype=shard.dtype, device=self.device)
            works.append(_all_gather(out, shard, group=self.distributed_process_group, async_op=True))
            outputs.append(out)
        for work in works:
            work.wait()
        return outputs

    @torch.no_grad()
    def state_dict(self, *, state_dict_format: int | None = None, gather_on_root: bool | None = None) -> dict:
        """The whole optimizer state, the same on every rank (all ranks must call it: it gathers).

        Upstream's v2 format: ``torch.optim``'s layout (``param_groups`` with parameter indices,
        ``state``) where ``state["step"]`` is the step count (an int) and ``state[i]`` holds
        ``param`` (the master values), ``exp_avg`` and ``exp_avg_sq`` of parameter ``i`` at its full
        shape, on the CPU, in ``dtype`` (fp32 and unscaled with ``with_scaled_states``, as upstream);
        plus ``"format": 2``. It does not depend on the number of
        ranks or the bucket size, so it loads at another world size. Upstream's deprecated v1
        format (``state_dict_format=1``, pickled per-rank shards) is not supported.
        """
        if state_dict_format not in (None, _STATE_DICT_FORMAT):
            raise ValueError(
                f"DistributedFusedAdam.state_dict: state_dict_format={state_dict_format} is not supported (only 2)"
            )
        if gather_on_root is not None:
            raise ValueError(
                "DistributedFusedAdam.state_dict: gather_on_root belongs to the v1 format, which is not supported"
            )
        self.grad_sync()
        self.param_sync()
        if self.with_scaled_states:
            gathered = {
                key: self._gather_shards([self._unscaled_state(b, which) for b in self._buckets])
                for which, key in enumerate(("param", "exp_avg", "exp_avg_sq"))
            }
            return self._assemble_state_dict(gathered, torch.float32)
        masters = []
        for bucket in self._buckets:
            if self.store_params:
                masters.append(bucket.params_shard)
            elif self.store_param_remainders:
                bf16 = self._pack_params(bucket, torch.bfloat16)
                masters.append(_distributed_adam_ops.bf16_and_remainder_to_fp32(bf16, bucket.param_remainders))
            else:
                masters.append(self._pack_params(bucket, self.dtype))
        gathered = {
            "param": self._gather_shards(masters),
            "exp_avg": self._gather_shards([b.exp_avg for b in self._buckets]),
            "exp_avg_sq": self._gather_shards([b.exp_avg_sq for b in self._buckets]),
        }
        return self._assemble_state_dict(gathered, self.dtype)

    def _assemble_state_dict(self, gathered: dict, dtype: torch.dtype) -> dict:
        """The v2 state dict from each key's gathered buckets."""
        index_of = {}
        param_groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = []
            for p in group["params"]:
                index_of.setdefault(p, len(index_of))
                packed["params"].append(index_of[p])
            param_groups.append(packed)
        state: dict = {"step": int(self.state["step"].item())}
        for p in self._ordered_params:
            entry = {}
            for key, buckets in gathered.items():
                full = torch.empty(p.numel(), dtype=dtype)
                for bucket in self._param_buckets[p]:
                    for f in bucket.fragments:
                        if f.param is p:
                            full[slice(*f.param_range)].copy_(buckets[bucket.index][slice(*f.bucket_range)])
                entry[key] = full.view(p.shape)
            state[index_of[p]] = entry
        return {"state": state, "param_groups": param_groups, "format": _STATE_DICT_FORMAT}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a :meth:`state_dict` (of any world size and bucket size). Hyperparameters come from
        the saved groups, as with ``torch.optim``. Without ``store_params`` the saved master values
        are not used (the model's parameters, loaded from the model's checkpoint, are); with
        ``store_param_remainders`` the remainders are taken from them, which assumes the model's
        bf16 parameters are the ones saved with this state."""
        name = "DistributedFusedAdam.load_state_dict"
        fmt = state_dict.get("format")
        if fmt != _STATE_DICT_FORMAT:
            raise ValueError(f"{name}: expected a state dict of format 2 (from state_dict()), got format={fmt!r}")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"{name}: the state dict has {len(saved_groups)} parameter groups, "
                f"the optimizer {len(self.param_groups)}"
            )
        for i, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"{name}: param_groups[{i}] has {len(saved['params'])} parameters in the state dict "
                    f"but {len(group['params'])} in the optimizer"
                )
        self.grad_sync()
        self.param_sync()
        saved_state = state_dict["state"]
        # Where each bucket's loaded values go: its state shards, or fp32 copies stored scaled after.
        targets = {
            b.index: (
                tuple(self._unscaled_state(b, which) for which in range(len(_SCALED)))
                if self.with_scaled_states
                else (b.params_shard, b.exp_avg, b.exp_avg_sq)
            )
            for b in self._buckets
        }
        for saved, group in zip(saved_groups, self.param_groups):
            for key, value in saved.items():
                if key == "params":
                    continue
                if key == "lr" and self.capturable:  # in place: a captured graph reads this tensor
                    group["lr"].copy_(torch.as_tensor(value))
                else:
                    group[key] = value
            for index, p in zip(saved["params"], group["params"]):
                if p not in self._param_range:
                    continue
                entry = saved_state.get(index)
                if entry is None:
                    raise ValueError(f"{name}: the state dict has no state for parameter {index}")
                for key in ("param", "exp_avg", "exp_avg_sq"):
                    if entry[key].shape != p.shape:
                        raise ValueError(
                            f"{name}: state[{index}][{key!r}] has shape {tuple(entry[key].shape)}, "
                            f"the parameter {tuple(p.shape)}"
                        )
                self._load_param_state(p, entry, targets)
        if self.with_scaled_states:
            for b in self._buckets:
                for which, values in enumerate(targets[b.index]):
                    self._store_scaled(b, which, values)
        self.state["step"].fill_(float(saved_state["step"]))

    def _load_param_state(self, p: torch.Tensor, entry: dict, targets: dict) -> None:
        for bucket in self._param_buckets[p]:
            masters, exp_avg, exp_avg_sq = targets[bucket.index]
            for f in self._local_fragments(bucket):
                if f.param is not p:
                    continue
                shard, source = slice(*f.shard_range), slice(*f.shard_param_range)
                exp_avg[shard].copy_(entry["exp_avg"].reshape(-1)[source])
                exp_avg_sq[shard].copy_(entry["exp_avg_sq"].reshape(-1)[source])
                master = entry["param"].reshape(-1)[source].to(self.device)
                if masters is not None:
                    masters[shard].copy_(master)
                elif self.store_param_remainders:
                    _, remainder = _distributed_adam_ops.fp32_to_bf16_and_remainder(master.float())
                    bucket.param_remainders[shard].copy_(remainder)

    def __del__(self):
        hook = getattr(self, "_forward_hook", None)
        if hook is not None:
            hook.remove()


def scaled_state_peak(dtype: torch.dtype) -> float:
    """What a fragment's largest magnitude becomes in scaled state (``with_scaled_states``): half of
    fp16's largest value, as upstream; 1 for bf16, whose range is fp32's. (Upstream's target, half of
    bf16's largest value, makes the factor's inverse overflow fp32 for every tensor whose values are
    all below 0.5, and its state inf or NaN.)"""
    return torch.finfo(torch.float16).max / 2 if dtype == torch.float16 else 1.0


def _drop_grad(param: torch.Tensor) -> None:
    """The hook of an empty trainable parameter: like every parameter of the optimizer, it is left
    with ``param.grad`` None after backward. Otherwise ``GradScaler.unscale_(optimizer)`` would still
    find its (empty) gradient and run torch's unscale kernel on it, which on CUDA has no bf16 variant,
    failing before :meth:`DistributedFusedAdam.step` can say that ``unscale_grads`` is the way."""
    param.grad = None


def _check_number(owner: str, name: str, value, allow_tensor: bool = False) -> None:
    if allow_tensor and isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{owner}: {name} must have one element, got shape {tuple(value.shape)}")
        return
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be a number, got {type(value).__name__}")
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{owner}: invalid {name}={value}; expected a finite number >= 0")


def _resolve_device(owner: str, device) -> torch.device:
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"{owner}: invalid device={device!r}") from error
    if device.type == "cuda" and device.index is None:
        if not torch.cuda.is_available():
            raise ValueError(f"{owner}: device='cuda' but CUDA is not available; pass device='cpu' for CPU parameters")
        device = torch.device("cuda", torch.cuda.current_device())
    return device
