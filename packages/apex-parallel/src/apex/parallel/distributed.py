"""Data-parallel training: gradients all-reduced in buckets while the backward pass runs.

Design. ``DistributedDataParallel`` is our own reducer in Python on public ``torch.distributed``
collectives, not a wrapper of ``torch.nn.parallel.DistributedDataParallel``: torch's reducer has
no equivalent of upstream Apex's ``delay_allreduce``, bucket order learned from the first
backward pass, ``allreduce_always_fp32`` with pre- and post-division, ``retain_allreduce_buffers``,
or ``enable_allreduce()``/``disable_allreduce()`` as a switch rather than a context, and it needs
``find_unused_parameters=True`` (a graph traversal every step and, for parameters unused on every
rank, a host sync) where Apex semantics say "a rank without a gradient reduces zeros". The pieces:

- one ``Tensor.register_post_accumulate_grad_hook`` per parameter: it fires once per backward
  pass, after the gradient has been accumulated into ``.grad`` (tied parameters too);
- the first backward pass (and after a parameter's ``requires_grad`` changes) is a learning pass:
  hooks record the order gradients arrive in, everything is reduced at the end, and rank 0's order
  is broadcast so that every rank builds the same buckets (one dtype each, closed at
  ``message_size`` elements, or at each of ``allreduce_trigger_params``);
- later passes launch a bucket as soon as its last gradient arrives, strictly in bucket order, so
  every rank issues the same collectives in the same order whatever order its gradients come in;
- a bucket is flattened (apex.core's ``flatten``; converted to fp32 on the way with
  ``allreduce_always_fp32``), pre-divided, all-reduced, post-multiplied and copied back into the
  gradients. On CUDA this all runs on a side stream that first waits for the stream the gradient
  was produced on, so it overlaps the rest of the backward pass; on the CPU (gloo) the all-reduce
  is asynchronous and completed at the end;
- a callback queued on the autograd engine (``Variable._execution_engine.queue_callback``, the
  hook torch's own FSDP uses; there is no public end-of-backward hook) runs when the backward pass
  ends: it gives every parameter that got no gradient on this rank a zero gradient, reduces the
  buckets not launched yet, and makes the caller's stream wait for the side streams (a device-side
  wait: the host never blocks on an event here).

Waiting never outlasts the process group: the only host-side waits are on gloo work objects,
which fail after the ``timeout`` given to ``torch.distributed.init_process_group``; NCCL's
watchdog aborts a collective that exceeds it. A rank that dies or stops answering thus ends the
others with an error instead of a hang.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import warnings
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from apex.core.tensor_lists import flatten, unflatten

_SHARED_PARAM_REMOVED = (
    "shared_param is no longer supported as an option. It was misleadingly named from the start: "
    "overlapping communication with computation works fine with shared parameters. If you still wish to "
    "delay communication to the end of the backward pass, use delay_allreduce=True; to choose where "
    "buckets end, use allreduce_trigger_params."
)


def _require_process_group(owner: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{owner}: the default process group is not initialized; call "
            "torch.distributed.init_process_group(backend, timeout=...) first"
        )


def _by_dtype_and_device(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return list(groups.values())


@torch.no_grad()
def _coalesced(tensors: Sequence[torch.Tensor], collective, average: bool = False, group=None) -> None:
    """Run ``collective(flat)`` on one flat buffer per dtype/device of ``tensors``, then copy back."""
    world = dist.get_world_size(group)
    for same_kind in _by_dtype_and_device(tensors):
        flat = flatten(same_kind)
        collective(flat)
        if average:
            flat.div_(world)
        for t, synced in zip(same_kind, unflatten(flat, same_kind)):
            t.copy_(synced)


def _broadcast_from_rank0(tensors: Sequence[torch.Tensor]) -> None:
    _coalesced(tensors, lambda flat: dist.broadcast(flat, src=0))


# all_gather_single supersedes all_gather_into_tensor where it exists (a flat output suits both).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _check_same_module(owner: str, module: nn.Module, device: torch.device, buffers: bool) -> None:
    """Raise on every rank unless every rank holds parameters (and, with ``buffers``, the buffers on
    ``device``) of the same shapes and dtypes, as torch's DDP verifies: a broadcast of mismatched
    tensors aborts a gloo rank, and one of equal sizes but other shapes would train silently. One
    all-gather of an 8-byte fingerprint; the descriptions are gathered only when fingerprints differ."""
    described = [(f"parameter {n!r}", tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()]
    counts = [len(described)]
    if buffers:
        on_device = [(f"buffer {n!r}", tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers()]
        on_device = [d for d, b in zip(on_device, module.buffers()) if b.device == device]
        described += on_device
        counts.append(len(on_device))
    digest = hashlib.blake2b(repr((counts, [d[1:] for d in described])).encode(), digest_size=8).digest()
    fingerprint = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64, device=device)
    world = dist.get_world_size()
    gathered = fingerprint.new_empty(world)
    _all_gather(gathered, fingerprint)
    fingerprints = gathered.tolist()
    if len(set(fingerprints)) == 1:
        return
    everyone: list = [None] * world
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        dist.all_gather_object(everyone, (counts, described))
    rank = dist.get_rank()
    other = next(r for r in range(world) if fingerprints[r] != fingerprints[rank])
    their_counts, theirs = everyone[other]

    def tally(c):
        return f"{c[0]} parameters" + (f" and {c[1]} buffers" if buffers else "")

    detail = f"rank {rank} has {tally(counts)} but rank {other} has {tally(their_counts)}"
    if their_counts == counts:
        for (what, shape, dtype), (_, their_shape, their_dtype) in zip(described, theirs):
            if (shape, dtype) != (their_shape, their_dtype):
                detail = (
                    f"{what} has shape {shape} and dtype {dtype} on rank {rank} but shape {their_shape} "
                    f"and dtype {their_dtype} on rank {other}"
                )
                break
    raise ValueError(
        f"{owner}: module differs across ranks: {detail}; every rank must hold the same model "
        "(the same parameters and buffers, with the same shapes and dtypes, in the same order)"
    )


def _zero_missing_grads(params: Iterable[torch.nn.Parameter]) -> None:
    """A parameter without a gradient takes part in the reduction with zeros (consistent across ranks)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


class DistributedDataParallel(nn.Module):
    r"""Wrap ``module`` for data-parallel training on ``torch.distributed``, as upstream Apex's DDP.

    At construction the parameters and buffers of ``module`` are broadcast from rank 0, so every
    rank starts from the same weights. In every backward pass the gradients are averaged over the
    ranks: grouped into buckets of about ``message_size`` elements (one dtype per bucket), each
    bucket all-reduced as soon as its last gradient is ready while the backward pass goes on
    (or everything at the end with ``delay_allreduce=True``). With world size :math:`W`,
    predivide factor :math:`f` and local gradients :math:`g_r`, each gradient becomes

    .. math::
        g \leftarrow \frac{f}{W} \sum_r \frac{g_r}{f} \quad(\texttt{gradient\_average=True}),
        \qquad g \leftarrow \sum_r \frac{g_r}{f} \quad(\texttt{gradient\_average=False}).

    The process group comes from ``torch.distributed.init_process_group`` (NCCL with the module
    on this rank's GPU, or gloo on the CPU); its ``timeout`` bounds every wait, so a rank that
    dies or hangs ends the others with an error. One device per process.

    Unused parameters. A parameter that requires grad but gets no gradient in a backward pass on
    some rank (a branch taken on some ranks or iterations, a layer never used) takes part with
    zeros: after the pass every parameter that requires grad has the averaged gradient, zero where
    no rank produced one. (Torch's DDP with ``find_unused_parameters=True`` instead leaves such a
    gradient ``None`` when it is unused on every rank, at the price of a host sync.) Every rank must
    run the backward pass through the model, on a loss that depends on at least one parameter.

    Gradient accumulation: call ``disable_allreduce()`` for the micro-batches whose gradients
    should only accumulate locally and ``enable_allreduce()`` before the last one; that backward
    pass reduces the accumulated ``.grad``.

    The first backward pass (and the first after ``requires_grad`` of a parameter changes) reduces
    all gradients at its end while it records the order they arrive in; later passes overlap. The
    buckets follow rank 0's order. Parameters added to ``module`` after construction are not seen.
    A ``torch.utils.checkpoint`` with ``use_reentrant=True`` whose nested backward produces the
    first gradient of the pass is not supported (use ``use_reentrant=False``).

    Args:
        module: the network (all parameters on one device: this rank's GPU with NCCL).
        message_size: bucket size in elements; a bucket is closed once it holds at least this many.
        delay_allreduce: reduce everything when the backward pass ends instead of overlapping.
        shared_param: removed; passing it raises ``ValueError`` (as upstream).
        allreduce_trigger_params: parameters whose gradient closes a bucket (instead of
            ``message_size``); not with ``delay_allreduce``.
        retain_allreduce_buffers: keep each reduced flat bucket in ``self.allreduce_buffers`` and
            make the gradients views into it instead of copying back.
        allreduce_always_fp32: convert fp16/bf16 buckets to fp32 for the reduction (upstream converts
            every dtype, so fp64 is reduced in fp32 too).
        num_allreduce_streams: spread buckets round-robin over this many streams and process groups
            (new groups are created here, a collective call); not with ``delay_allreduce``.
        allreduce_communicators: ``(groups, streams)``, ``num_allreduce_streams`` of each, to use
            instead of creating them (streams are ignored off CUDA).
        gradient_average: divide the sum by the world size (see the formula).
        gradient_predivide_factor: :math:`f`, divide before the all-reduce to keep fp16 sums in range.
        gradient_average_split_factor: deprecated name of ``gradient_predivide_factor`` (warns).
        prof: NVTX ranges around the bucket work (CUDA).
    """

    def __init__(
        self,
        module: nn.Module,
        message_size: int = 10000000,
        delay_allreduce: bool = False,
        shared_param=None,
        allreduce_trigger_params=None,
        retain_allreduce_buffers: bool = False,
        allreduce_always_fp32: bool = False,
        num_allreduce_streams: int = 1,
        allreduce_communicators=None,
        gradient_average: bool = True,
        gradient_predivide_factor: float = 1.0,
        gradient_average_split_factor: float | None = None,
        prof: bool = False,
    ):
        super().__init__()
        if shared_param is not None:
            raise ValueError(_SHARED_PARAM_REMOVED)
        if gradient_average_split_factor is not None:
            warnings.warn(
                "gradient_average_split_factor has been renamed to gradient_predivide_factor; the old name "
                "still works for now, but please use gradient_predivide_factor",
                FutureWarning,
                stacklevel=2,
            )
            gradient_predivide_factor = gradient_average_split_factor
        if not isinstance(module, nn.Module):
            raise TypeError(f"DistributedDataParallel: module must be a torch.nn.Module, got {type(module).__name__}")
        if isinstance(message_size, bool) or not isinstance(message_size, int) or message_size < 1:
            raise ValueError(f"DistributedDataParallel: message_size must be a positive int, got {message_size!r}")
        if isinstance(num_allreduce_streams, bool) or not isinstance(num_allreduce_streams, int):
            raise ValueError(
                f"DistributedDataParallel: num_allreduce_streams must be an int, got {num_allreduce_streams!r}"
            )
        if num_allreduce_streams < 1:
            raise ValueError(
                f"DistributedDataParallel: num_allreduce_streams must be >= 1, got {num_allreduce_streams}"
            )
        if not gradient_predivide_factor > 0:
            raise ValueError(
                f"DistributedDataParallel: gradient_predivide_factor must be positive, got {gradient_predivide_factor}"
            )
        if delay_allreduce and num_allreduce_streams > 1:
            raise ValueError(
                "DistributedDataParallel: num_allreduce_streams > 1 may only be used with delay_allreduce=False"
            )
        if delay_allreduce and allreduce_trigger_params is not None:
            raise ValueError(
                "DistributedDataParallel: allreduce_trigger_params is only valid with delay_allreduce=False"
            )
        if allreduce_communicators is not None:
            groups, streams = allreduce_communicators
            if num_allreduce_streams < 2 or len(groups) != num_allreduce_streams or len(streams) != len(groups):
                raise ValueError(
                    "DistributedDataParallel: allreduce_communicators must be (groups, streams) with "
                    f"num_allreduce_streams (> 1) of each; got {len(groups)} groups, {len(streams)} streams "
                    f"for num_allreduce_streams={num_allreduce_streams}"
                )
        params = list(module.parameters())
        if not any(p.requires_grad for p in params):
            raise ValueError(
                "DistributedDataParallel: module has no parameter that requires grad; there is nothing to reduce"
            )
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(
                f"DistributedDataParallel: parameters are on several devices {sorted(map(str, devices))}; "
                "use one device per process"
            )
        _require_process_group("DistributedDataParallel")
        (self._device,) = devices
        if dist.get_backend() == dist.Backend.NCCL and self._device.type != "cuda":
            raise ValueError("DistributedDataParallel: the NCCL backend needs the module's parameters on a GPU")

        self.module = module
        self.message_size = message_size
        self.delay_allreduce = delay_allreduce
        self.retain_allreduce_buffers = retain_allreduce_buffers
        self.allreduce_always_fp32 = allreduce_always_fp32
        self.num_allreduce_streams = num_allreduce_streams
        self.gradient_average = gradient_average
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.prof = prof
        self.world_size = dist.get_world_size()
        self.allreduce_buffers: list[torch.Tensor | None] = []
        self._allreduce_disabled = False

        self._params = params
        self._param_index = {id(p): i for i, p in enumerate(params)}
        self._triggers = None
        if allreduce_trigger_params is not None:
            unknown = [p for p in allreduce_trigger_params if id(p) not in self._param_index]
            if unknown:
                raise ValueError(
                    "DistributedDataParallel: allreduce_trigger_params holds tensors that are not parameters of module"
                )
            self._triggers = {self._param_index[id(p)] for p in allreduce_trigger_params}

        self._on_cuda = self._device.type == "cuda"
        if allreduce_communicators is not None:
            self._groups = list(allreduce_communicators[0])
            self._streams = list(allreduce_communicators[1]) if self._on_cuda else [None] * num_allreduce_streams
        else:
            self._groups = (
                [None] if num_allreduce_streams == 1 else [dist.new_group() for _ in range(num_allreduce_streams)]
            )
            self._streams = [
                torch.cuda.Stream(device=self._device) if self._on_cuda else None for _ in range(num_allreduce_streams)
            ]

        _check_same_module("DistributedDataParallel", module, self._device, buffers=True)
        buffers = [b for b in module.buffers() if b.device == self._device]
        _broadcast_from_rank0([p.detach() for p in params] + buffers)

        self._hooks: dict[int, object] = {}
        self._active: list[int] = []
        self._buckets: list[list[int]] = []  # learned, overlapped structure
        self._bucket_of: dict[int, int] = {}
        self._bucket_sizes: list[int] = []
        self._static_buckets: list[list[int]] = []  # registration order: learning passes, delay_allreduce
        self._refresh()
        self._reset_pass()

    # Public switches, as upstream ---------------------------------------------------------

    def enable_allreduce(self) -> None:
        """Reduce gradients in the following backward passes (the default)."""
        self._allreduce_disabled = False

    def disable_allreduce(self) -> None:
        """Only accumulate gradients locally in the following backward passes."""
        self._allreduce_disabled = True

    def forward(self, *inputs, **kwargs):
        if self._callback_queued:  # the previous backward pass raised before it finished
            self._reset_pass()
        if not self._allreduce_disabled and [i for i, p in enumerate(self._params) if p.requires_grad] != self._active:
            self._refresh()
        return self.module(*inputs, **kwargs)

    # Bucket structure ---------------------------------------------------------------------

    def _refresh(self) -> None:
        """(Re)build what depends on which parameters require grad; the next pass learns the order."""
        self._active = [i for i, p in enumerate(self._params) if p.requires_grad]
        for i in self._active:
            if i not in self._hooks:
                self._hooks[i] = self._params[i].register_post_accumulate_grad_hook(
                    functools.partial(self._grad_ready, i)
                )
        self._static_buckets = self._split(self._active, use_triggers=False)
        self._needs_refresh = True

    def _split(self, order: Sequence[int], use_triggers: bool) -> list[list[int]]:
        """Buckets of one dtype each, in ``order``, closed at message_size elements (or at a trigger)."""
        running: dict[torch.dtype, tuple[list[int], int]] = {}
        buckets = []
        for i in order:
            p = self._params[i]
            members, numel = running.get(p.dtype, ([], 0))
            members.append(i)
            numel += p.numel()
            if use_triggers and self._triggers is not None:
                close = i in self._triggers
            else:
                close = numel >= self.message_size
            if close:
                buckets.append(members)
                members, numel = [], 0
            running[p.dtype] = (members, numel)
        buckets.extend(members for members, _ in running.values() if members)
        return buckets

    def _learn_buckets(self, arrival: list[int]) -> None:
        """Buckets in the order gradients arrived on rank 0 (unarrived last, in reverse registration order)."""
        active = set(self._active)
        order = [i for i in dict.fromkeys(arrival) if i in active]
        arrived = set(order)
        order += [i for i in reversed(self._active) if i not in arrived]
        if self.world_size > 1:
            shared = torch.tensor(order, dtype=torch.int64, device=self._device)
            dist.broadcast(shared, src=0)
            order = shared.tolist()
            if sorted(order) != self._active:
                raise RuntimeError(
                    "DistributedDataParallel: the parameters that require grad differ between this rank and rank 0"
                )
        self._buckets = self._split(order, use_triggers=True)
        self._bucket_of = {i: b for b, members in enumerate(self._buckets) for i in members}
        self._bucket_sizes = [len(members) for members in self._buckets]
        self._needs_refresh = False

    # One backward pass --------------------------------------------------------------------

    def _reset_pass(self) -> None:
        self._callback_queued = False
        self._arrival: list[int] = []
        self._filled = [False] * len(self._params)
        self._ready_counts = [0] * len(self._buckets)
        self._next_bucket = 0
        self._pending: list[tuple] = []
        self._used_streams: set[int] = set()

    def _grad_ready(self, index: int, param: torch.Tensor) -> None:
        if self._allreduce_disabled:
            return
        if not self._callback_queued:
            Variable._execution_engine.queue_callback(self._finish_pass)
            self._callback_queued = True
            self.allreduce_buffers = []
        if self.delay_allreduce:
            return
        if self._needs_refresh:
            self._arrival.append(index)
            return
        if self._filled[index]:
            raise RuntimeError(
                "DistributedDataParallel: a parameter's gradient was accumulated twice in one backward pass "
                "(a reentrant torch.utils.checkpoint? use use_reentrant=False)"
            )
        self._filled[index] = True
        bucket = self._bucket_of[index]
        self._ready_counts[bucket] += 1
        sizes = self._bucket_sizes
        while self._next_bucket < len(sizes) and self._ready_counts[self._next_bucket] == sizes[self._next_bucket]:
            self._launch(self._buckets[self._next_bucket], self._next_bucket)
            self._next_bucket += 1

    def _finish_pass(self) -> None:
        try:
            if self.delay_allreduce or self._needs_refresh:
                _zero_missing_grads(self._params[i] for i in self._active)
                for b, members in enumerate(self._static_buckets):
                    self._launch(members, b)
                self._complete()
                if self._needs_refresh and not self.delay_allreduce:
                    self._learn_buckets(self._arrival)
            else:
                for b in range(self._next_bucket, len(self._buckets)):
                    _zero_missing_grads(self._params[i] for i in self._buckets[b])
                    self._launch(self._buckets[b], b)
                self._complete()
        finally:
            self._reset_pass()

    def _nvtx(self, name: str):
        return torch.cuda.nvtx.range(name) if self.prof and self._on_cuda else contextlib.nullcontext()

    @torch.no_grad()
    def _launch(self, members: list[int], bucket: int) -> None:
        """Start the reduction of one bucket: on a side stream (CUDA), or asynchronously (CPU)."""
        params = [self._params[i] for i in members]
        grads = [p.grad for p in params]
        if any(g.is_sparse for g in grads):
            raise RuntimeError("DistributedDataParallel: sparse gradients are not supported")
        slot = bucket % self.num_allreduce_streams
        group = self._groups[slot]
        if not self._on_cuda:
            flat = self._flatten_and_predivide(grads)
            self._pending.append((dist.all_reduce(flat, group=group, async_op=True), flat, params, grads, bucket))
            return
        stream, main = self._streams[slot], torch.cuda.current_stream(self._device)
        stream.wait_stream(main)
        self._used_streams.add(slot)
        with self._nvtx(f"apex ddp bucket {bucket}"), torch.cuda.stream(stream):
            flat = self._flatten_and_predivide(grads)
            dist.all_reduce(flat, group=group)  # the host does not wait; the stream waits for NCCL's
            retained = self._write_back(flat, params, grads, bucket)
        if retained is not None:  # allocated on the side stream, then used and freed on the main one
            retained.record_stream(main)
            # The replaced gradients were made on the main stream and are read by the flatten on the
            # side stream: their memory must not be reused before that has run.
            for g in grads:
                g.record_stream(stream)

    def _flatten_and_predivide(self, grads: list[torch.Tensor]) -> torch.Tensor:
        if self.allreduce_always_fp32 and grads[0].dtype != torch.float32:
            flat = torch.empty(sum(g.numel() for g in grads), dtype=torch.float32, device=grads[0].device)
            torch.cat([g.reshape(-1) for g in grads], out=flat)
        else:
            flat = flatten(grads)
        if self.gradient_predivide_factor != 1.0:
            flat.mul_(1.0 / self.gradient_predivide_factor)
        return flat

    def _write_back(self, flat: torch.Tensor, params, grads, bucket: int) -> torch.Tensor | None:
        """Post-divide and copy into the gradients; returns the retained buffer, if any."""
        if self.gradient_average:
            post = self.gradient_predivide_factor / self.world_size
            if post != 1.0:
                flat.mul_(post)
        if not self.retain_allreduce_buffers:
            torch._foreach_copy_(grads, unflatten(flat, grads))
            return None
        if flat.dtype != grads[0].dtype:
            flat = flat.to(grads[0].dtype)
        while len(self.allreduce_buffers) <= bucket:
            self.allreduce_buffers.append(None)
        self.allreduce_buffers[bucket] = flat
        for p, view in zip(params, unflatten(flat, grads)):
            p.grad = view
        return flat

    def _complete(self) -> None:
        """Make the reduced gradients visible to what the caller runs next."""
        if self._on_cuda:
            current = torch.cuda.current_stream(self._device)
            for slot in sorted(self._used_streams):
                current.wait_stream(self._streams[slot])
            return
        for work, flat, params, grads, bucket in self._pending:
            work.wait()  # bounded by the process group's timeout
            with torch.no_grad():
                self._write_back(flat, params, grads, bucket)


class Reducer:
    """All-reduce (average) gradients when asked, as upstream Apex's ``Reducer``.

    Unlike :class:`DistributedDataParallel`, nothing happens during ``backward()``: call
    :meth:`reduce` when the gradients should be averaged over the ranks (for example every few
    iterations).

    Args:
        module_or_grads_list: a module, whose parameters are broadcast from rank 0 here and whose
            gradients :meth:`reduce` averages (a parameter that requires grad but has no gradient
            takes part with zeros, as in DDP); or an iterable (possibly nested) of gradient tensors,
            averaged in place by :meth:`reduce` (syncing those parameters is then up to you).
    """

    def __init__(self, module_or_grads_list):
        _require_process_group("Reducer")
        if isinstance(module_or_grads_list, nn.Module):
            self.module = module_or_grads_list
            self.grads = None
            first = next(self.module.parameters(), None)
            if first is not None:
                _check_same_module("Reducer", self.module, first.device, buffers=False)
            _broadcast_from_rank0([p.detach() for p in self.module.parameters()])
        else:
            self.module = None
            self.grads = []
            self._collect(module_or_grads_list)

    def _collect(self, item) -> None:
        if isinstance(item, torch.Tensor):
            self.grads.append(item)
        elif isinstance(item, Iterable) and not isinstance(item, (str, bytes)):
            for inner in item:
                self._collect(inner)
        else:
            raise TypeError(f"Reducer: expected a module or an iterable of tensors, found {type(item).__name__}")

    def reduce(self) -> None:
        """Average the gradients over all ranks, in place."""
        if self.module is not None:
            params = [p for p in self.module.parameters() if p.requires_grad]
            _zero_missing_grads(params)
            grads = [p.grad for p in params]
        else:
            grads = self.grads
        if grads:
            _coalesced(grads, dist.all_reduce, average=True)


__all__ = ["DistributedDataParallel", "Reducer"]
