"""Input-channel permutation before 2:4 pruning (upstream's ``permutation_lib.Permutation``).

Pruning 2:4 along the input channels C keeps, in every group of 4 consecutive channels, the 2
largest weights. Reordering the channels changes which weights share a group, so a good order
keeps more magnitude. A model computes the same function after its channels are reordered if,
for each tensor whose channels are reordered, the layer that produces it reorders its output
channels (weight rows and bias; "K dimension") and every layer that reads it reorders its input
channels (weight columns; "C dimension"), with every per-channel parameter in between (BatchNorm,
LayerNorm) reordered too.

:meth:`Permutation.permute_model` finds these sets with ``torch.fx.symbolic_trace``: a "channel
group" is a set of tensors joined by channel-preserving operations (activations, dropout,
pooling, BatchNorm/LayerNorm, element-wise sums and products of two such tensors, a flatten of a
1 x 1 map), together with
the Linear/Conv layers (``groups=1``) producing them and reading them. A group is permuted only
when it is closed: every tensor of it comes from a Linear/Conv layer, and every use of one is a
channel-preserving operation or a Linear/Conv layer reading it (not the model's output, a
flatten, a reshape, an unknown function...). For each such group the weights of the layers that
read it and are being pruned are laid side by side (create_mask's layout, ``[rows, C]``) and the
search of :func:`accelerated_search_for_good_permutation` picks the order (on the weights'
device). A model that torch.fx cannot trace is not permuted: a warning says so (upstream prints a
message and goes on, as we do).

Differences from upstream, on purpose: layers are matched by module identity, not by names
rebuilt from fx node names; a layer that reads a permuted tensor is permuted in C even when it
is not pruned (upstream then leaves the model inconsistent); the optimizer state and ASP's mask
buffers of permuted parameters are permuted with them; the searches use a private random
generator seeded by :meth:`set_identical_seed` instead of reseeding the global ones.
BatchNorm1d is treated as per-channel only after Conv1d layers (after a Linear its input may be
``[N, L, C]``, where it would not be), LayerNorm only over one last dimension after Linear layers.

A flatten of all dimensions after the batch one (``torch.flatten(x, 1)``, ``nn.Flatten()``,
``x.view(n, -1)``, ``x.reshape(n, -1)``) passes the channels on when the flattened map is 1 x 1
(after global pooling): the group's layers must then all agree on the channel count, which they
do only in that case.

Not handled (the group is left unpermuted, and says why with verbosity >= 2 or in
:meth:`Permutation.get_permutation_stats`): ``torch.cat`` of channel groups, other reshapes,
grouped and depthwise convolutions, MultiheadAttention's inner projections, GroupNorm and
InstanceNorm, and any function not listed below. Upstream also permutes through concatenations.

Called without ASP (no :meth:`Permutation.set_permutation_params_from_asp`), every Linear/Conv
reading a group steers the search; with ASP, only the weights ASP prunes.
"""

from __future__ import annotations

import json
import operator
import os
import warnings
from typing import ClassVar

import torch
import torch.fx
import torch.nn.functional as F

from apex.contrib.sparsity import _ops
from apex.contrib.sparsity.permutation_search_kernels import accelerated_search_for_good_permutation
from apex.contrib.sparsity.sparse_masklib import as_matrix


class PermutationWarning(UserWarning):
    """The channel permutation was skipped for a model or a group of layers."""


_ELEMENTWISE_MODULES = (
    torch.nn.ReLU,
    torch.nn.ReLU6,
    torch.nn.LeakyReLU,
    torch.nn.PReLU,
    torch.nn.ELU,
    torch.nn.SELU,
    torch.nn.CELU,
    torch.nn.GELU,
    torch.nn.SiLU,
    torch.nn.Mish,
    torch.nn.Sigmoid,
    torch.nn.Tanh,
    torch.nn.Hardtanh,
    torch.nn.Hardswish,
    torch.nn.Hardsigmoid,
    torch.nn.Softplus,
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.Identity,
)
_POOLING_MODULES = (
    torch.nn.MaxPool1d,
    torch.nn.MaxPool2d,
    torch.nn.MaxPool3d,
    torch.nn.AvgPool1d,
    torch.nn.AvgPool2d,
    torch.nn.AvgPool3d,
    torch.nn.AdaptiveAvgPool1d,
    torch.nn.AdaptiveAvgPool2d,
    torch.nn.AdaptiveAvgPool3d,
    torch.nn.AdaptiveMaxPool1d,
    torch.nn.AdaptiveMaxPool2d,
    torch.nn.AdaptiveMaxPool3d,
)
_ELEMENTWISE_FUNCTIONS = {
    F.relu,
    F.relu6,
    F.leaky_relu,
    F.elu,
    F.selu,
    F.celu,
    F.gelu,
    F.silu,
    F.mish,
    F.hardtanh,
    F.hardswish,
    F.hardsigmoid,
    F.softplus,
    F.dropout,
    torch.relu,
    torch.sigmoid,
    torch.tanh,
    torch.nn.functional.sigmoid,
    torch.nn.functional.tanh,
    operator.neg,
    torch.neg,
}
_POOLING_FUNCTIONS = {
    F.max_pool1d,
    F.max_pool2d,
    F.max_pool3d,
    F.avg_pool1d,
    F.avg_pool2d,
    F.avg_pool3d,
    F.adaptive_avg_pool1d,
    F.adaptive_avg_pool2d,
    F.adaptive_avg_pool3d,
}
_BINARY_FUNCTIONS = {
    operator.add,
    operator.iadd,
    operator.sub,
    operator.isub,
    operator.mul,
    operator.imul,
    operator.truediv,
    torch.add,
    torch.sub,
    torch.mul,
    torch.div,
}
_ELEMENTWISE_METHODS = {
    "relu",
    "relu_",
    "sigmoid",
    "sigmoid_",
    "tanh",
    "tanh_",
    "neg",
    "contiguous",
    "clone",
    "detach",
}
_BINARY_METHODS = {"add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_"}
_METADATA_METHODS = {"size", "dim"}
_METADATA_ATTRIBUTES = {"shape", "dtype", "device", "ndim"}


def _is_channel_layer(module) -> bool:
    """A Linear or an ungrouped Conv: weight ``[K, C, ...]``, output channels K, input channels C."""
    if isinstance(module, torch.nn.Linear):
        return True
    return isinstance(module, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)) and module.groups == 1


# Where a tensor's channels are: "conv", dimension 1 of an N-D activation (a Conv's output);
# "flat", dimension 1 of a 2-D [N, C] tensor (a flattened one); "last", the last dimension of a
# tensor of unknown rank (a Linear's output).
def _output_layout(module) -> str:
    return "last" if isinstance(module, torch.nn.Linear) else "conv"


def _input_layouts(module) -> set[str]:
    """The layouts of an input whose channels the module's parameters follow."""
    if isinstance(module, (torch.nn.Linear, torch.nn.LayerNorm)):
        return {"last", "flat"}
    if isinstance(module, torch.nn.BatchNorm1d):
        return {"conv", "flat"}
    return {"conv"}


def _flattens_channels(node: torch.fx.Node, module=None) -> bool:
    """Whether the node flattens all dimensions after the first (batch) one: ``torch.flatten(x, 1)``,
    ``x.flatten(1)``, ``nn.Flatten()``, ``x.view(n, -1)``, ``x.reshape(n, -1)``. The channel
    order survives only where the dimensions after the channels have size 1; the channel-count
    check of the group (every layer agrees on C) guarantees that."""
    if module is not None:
        return isinstance(module, torch.nn.Flatten) and module.start_dim == 1 and module.end_dim == -1
    args, kwargs = node.args, node.kwargs
    if (node.op == "call_function" and node.target is torch.flatten) or (
        node.op == "call_method" and node.target == "flatten"
    ):
        start = args[1] if len(args) > 1 else kwargs.get("start_dim", 0)
        end = args[2] if len(args) > 2 else kwargs.get("end_dim", -1)
        return start == 1 and end == -1
    if node.op == "call_method" and node.target in ("view", "reshape") and not kwargs:
        sizes = args[1:] if len(args) != 2 else (args[1] if isinstance(args[1], (tuple, list)) else (args[1],))
        return len(sizes) == 2 and sizes[1] == -1
    return False


class _Group:
    """One channel group while the graph is read."""

    def __init__(self, index: int):
        self.index = index
        self.producers: dict[int, tuple[str, torch.nn.Module]] = {}
        self.consumers: dict[int, tuple[str, torch.nn.Module]] = {}
        self.per_channel: dict[int, tuple[str, torch.nn.Module]] = {}
        self.blocked: list[str] = []

    def absorb(self, other: _Group) -> None:
        self.producers.update(other.producers)
        self.consumers.update(other.consumers)
        self.per_channel.update(other.per_channel)
        self.blocked += other.blocked


class _Groups:
    """Union-find of channel groups."""

    def __init__(self):
        self.parent: list[int] = []
        self.groups: list[_Group] = []

    def new(self, blocked: str | None = None) -> int:
        index = len(self.groups)
        self.parent.append(index)
        self.groups.append(_Group(index))
        if blocked:
            self.groups[index].blocked.append(blocked)
        return index

    def find(self, index: int) -> int:
        while self.parent[index] != index:
            self.parent[index] = self.parent[self.parent[index]]
            index = self.parent[index]
        return index

    def get(self, index: int) -> _Group:
        return self.groups[self.find(index)]

    def union(self, a: int, b: int) -> int:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.groups[ra].absorb(self.groups[rb])
            self.parent[rb] = ra
        return ra

    def roots(self) -> list[_Group]:
        return [g for i, g in enumerate(self.groups) if self.find(i) == i]


def _nodes_in(value) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(value, found.append)
    return found


def find_channel_groups(traced: torch.fx.GraphModule) -> list[_Group]:
    """The channel groups of a traced model (closed or not; ``blocked`` says why not)."""
    groups = _Groups()
    group_of: dict[torch.fx.Node, int] = {}
    layout_of: dict[torch.fx.Node, str] = {}
    metadata: set[torch.fx.Node] = set()

    def new(node: torch.fx.Node, reason: str | None, layout: str = "unknown") -> int:
        group_of[node] = groups.new(reason)
        layout_of[node] = layout
        return group_of[node]

    def block_inputs(node: torch.fx.Node, reason: str) -> None:
        for arg in _nodes_in((node.args, node.kwargs)):
            if arg in group_of:
                groups.get(group_of[arg]).blocked.append(f"{reason} ({node.format_node()})")

    def pass_through(node: torch.fx.Node, tensors: list[torch.fx.Node], allowed=None, output=None) -> int | None:
        """The node's output joins its inputs' group (all of them, for a binary operation); the
        inputs' layouts must agree and be in ``allowed``; the output has layout ``output``
        (default: the inputs')."""
        tracked = [t for t in tensors if t in group_of]
        if not tracked:
            new(node, f"made from untracked values ({node.format_node()})")
            return None
        index = group_of[tracked[0]]
        for other in tracked[1:]:
            index = groups.union(index, group_of[other])
        layouts = {layout_of[t] for t in tracked}
        layout = layouts.pop() if len(layouts) == 1 else "mixed"
        if layout == "mixed" or (allowed is not None and layout not in allowed):
            groups.get(index).blocked.append(f"met in an unsupported layout ({layout}) by {node.format_node()}")
        group_of[node] = index
        layout_of[node] = output or layout
        return index

    def per_channel(node: torch.fx.Node, module, inputs) -> None:
        index = pass_through(node, inputs, allowed=_input_layouts(module))
        if index is not None:
            groups.get(index).per_channel[id(module)] = (node.target, module)

    for node in traced.graph.nodes:
        if node.op == "placeholder":
            new(node, f"a model input ({node.name})")
        elif node.op == "get_attr":
            new(node, f"a tensor attribute ({node.target})")
        elif node.op == "output":
            block_inputs(node, "the model's output")
        elif node.op == "call_module":
            module = traced.get_submodule(node.target)
            inputs = [n for n in _nodes_in((node.args, node.kwargs)) if n not in metadata]
            if len(inputs) != 1:
                block_inputs(node, f"read by {type(module).__name__} with several inputs")
                new(node, f"made by {type(module).__name__} ({node.target})")
            elif _is_channel_layer(module):
                source = inputs[0]
                group = groups.get(group_of[source])
                group.consumers[id(module)] = (node.target, module)
                if layout_of[source] not in _input_layouts(module):
                    group.blocked.append(f"read by {node.target} in an unsupported layout ({layout_of[source]})")
                index = new(node, None, _output_layout(module))
                groups.get(index).producers[id(module)] = (node.target, module)
            elif isinstance(module, _ELEMENTWISE_MODULES):
                pass_through(node, inputs)
            elif isinstance(module, _POOLING_MODULES):
                pass_through(node, inputs, allowed={"conv"})
            elif isinstance(module, (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)):
                per_channel(node, module, inputs)
            elif isinstance(module, torch.nn.LayerNorm) and len(module.normalized_shape) == 1:
                per_channel(node, module, inputs)
            elif _flattens_channels(node, module):
                pass_through(node, inputs, allowed={"conv", "flat"}, output="flat")
            else:
                block_inputs(node, f"read by {type(module).__name__}")
                new(node, f"made by {type(module).__name__} ({node.target})")
        else:  # call_function, call_method
            target = node.target
            inputs = [n for n in _nodes_in((node.args, node.kwargs)) if n not in metadata]
            is_method = node.op == "call_method"
            if (is_method and target in _METADATA_METHODS) or (
                target is getattr and len(node.args) == 2 and node.args[1] in _METADATA_ATTRIBUTES
            ):
                metadata.add(node)
            elif (is_method and target in _ELEMENTWISE_METHODS) or (not is_method and target in _ELEMENTWISE_FUNCTIONS):
                if len(inputs) == 1:
                    pass_through(node, inputs)
                else:
                    block_inputs(node, "an element-wise function of several tensors")
                    new(node, f"made by {node.format_node()}")
            elif (is_method and target in _BINARY_METHODS) or (not is_method and target in _BINARY_FUNCTIONS):
                pass_through(node, inputs)
            elif not is_method and target in _POOLING_FUNCTIONS and len(inputs) == 1:
                pass_through(node, inputs, allowed={"conv"})
            elif len(inputs) == 1 and _flattens_channels(node):
                pass_through(node, inputs, allowed={"conv", "flat"}, output="flat")
            else:
                block_inputs(node, "read by an operation that may mix channels")
                new(node, f"made by {node.format_node()}")
    return groups.roots()


def _check_group(group: _Group, sparse: set[int] | None) -> tuple[str | None, int]:
    """Why a group cannot be permuted (None if it can), and its channel count."""
    if group.blocked:
        return "its channels " + "; ".join(dict.fromkeys(group.blocked)), 0
    if not group.consumers:
        return "no layer reads it", 0
    channels = {int(m.weight.shape[0]) for _, m in group.producers.values()}
    channels |= {int(m.weight.shape[1]) for _, m in group.consumers.values()}
    for _, module in group.per_channel.values():
        for name in ("weight", "bias", "running_mean", "running_var"):
            t = getattr(module, name, None)
            if isinstance(t, torch.Tensor):
                channels.add(int(t.shape[0]))
    if len(channels) != 1:
        return f"its layers disagree on the channel count ({sorted(channels)})", 0
    count = channels.pop()
    if count % 4 or count < 8:
        return f"{count} channels (a multiple of 4, at least 8, is needed)", count
    if sparse is not None and not any(id(m.weight) in sparse for _, m in group.consumers.values()):
        return "none of the layers reading it is pruned", count
    return None, count


class Permutation:
    """Channel permutation of a model before pruning (all classmethods, one global state)."""

    _model = None
    _sparse_parameters: ClassVar[list] = []
    _all_parameters: ClassVar[list] = []
    _verbosity = 0
    _allow_permutation = False
    _save_permutation_graph = False
    _permutation_output_dir = "."
    _identical_seed = 1
    _tcpstore_port = 2341
    _search_options: dict | None = None
    _sparse_ids: set[int] | None = None
    _params_permuted_in_C: ClassVar[list[str]] = []
    _params_permuted_in_K: ClassVar[list[str]] = []
    _unpermuted_dims: ClassVar[list[str]] = []

    @classmethod
    def _reset_state(cls) -> None:
        cls._model = None
        cls._sparse_parameters = []
        cls._all_parameters = []
        cls._verbosity = 0
        cls._allow_permutation = False
        cls._save_permutation_graph = False
        cls._permutation_output_dir = "."
        cls._identical_seed = 1
        cls._search_options = None
        cls._sparse_ids = None
        cls._params_permuted_in_C = []
        cls._params_permuted_in_K = []
        cls._unpermuted_dims = []

    @classmethod
    def set_identical_seed(cls, identical_seed=1):
        """The seed of the searches' random perturbations: identical on every rank, so every rank
        finds the same permutation of identical weights. Ours seeds a private generator (upstream
        reseeds torch, NumPy and random globally)."""
        cls._identical_seed = int(identical_seed)

    @classmethod
    def set_tcpstore_port(cls, tcpstore_port):
        """Accepted for upstream compatibility; no store is used (the identical seed suffices)."""
        cls._tcpstore_port = tcpstore_port

    @classmethod
    def set_permutation_saving_params(
        cls, allow_permutation=False, save_permutation_graph=False, permutation_output_dir="."
    ):
        cls._allow_permutation = allow_permutation
        cls._save_permutation_graph = save_permutation_graph
        cls._permutation_output_dir = permutation_output_dir

    @classmethod
    def set_permutation_params_from_asp(cls, model, sparse_parameters, all_parameters, verbosity=0):
        """ASP's model, its pruned parameters (``(module_name, module, p_name, p, mask, pruned)``
        tuples; only these weights steer the search) and all its parameters."""
        cls._model = model
        cls._sparse_parameters = sparse_parameters
        cls._all_parameters = all_parameters
        cls._verbosity = verbosity
        cls._sparse_ids = {id(entry[3]) for entry in sparse_parameters}
        cls._params_permuted_in_C = []
        cls._params_permuted_in_K = []
        cls._unpermuted_dims = []

    @classmethod
    def get_permutation_stats(cls):
        """``(params permuted in C, params permuted in K, unpermuted dims)`` of the permutations
        applied so far, as ``"<module>.<parameter>"`` names and, for the groups left alone,
        ``"<consumer names>: <reason>"``."""
        return cls._params_permuted_in_C, cls._params_permuted_in_K, cls._unpermuted_dims

    @classmethod
    def set_search_options(cls, options: dict | None):
        """The options of :func:`accelerated_search_for_good_permutation` (ours; default: exhaustive
        search over windows of 8 channels, 100 escape attempts)."""
        cls._search_options = dict(options) if options else None

    @classmethod
    def permute_model(
        cls, model, dump_fx_graph=False, save_dumped_fx_graph="./model_permutation_graph.json", optimizer=None
    ) -> bool:
        """Permute the input channels of the model's layers so that 2:4 pruning keeps more
        magnitude, without changing what the model computes. Returns whether the model could
        be traced (then each closed channel group whose search gained was permuted); False,
        with a PermutationWarning, when torch.fx cannot trace it.

        ``optimizer`` (ours): its per-parameter state is permuted with the parameters.
        """
        try:
            traced = torch.fx.symbolic_trace(model)
        except Exception as error:  # any tracing failure: upstream also skips the permutation
            warnings.warn(
                f"[ASP] channel permutation skipped: torch.fx cannot trace {type(model).__name__} "
                f"({type(error).__name__}: {error}); the masks are computed on the unpermuted weights",
                PermutationWarning,
                stacklevel=2,
            )
            return False
        records = []
        for group in find_channel_groups(traced):
            if not group.consumers:
                continue
            record = cls._permute_group(group, optimizer)
            records.append(record)
        if dump_fx_graph:
            directory = os.path.dirname(save_dumped_fx_graph)
            if directory:
                os.makedirs(directory, exist_ok=True)
            with open(save_dumped_fx_graph, "w") as f:
                json.dump({"graph": str(traced.graph), "channel_groups": records}, f, indent=2)
        return True

    @classmethod
    def _permute_group(cls, group: _Group, optimizer) -> dict:
        record = {
            "producers": sorted(name for name, _ in group.producers.values()),
            "consumers": sorted(name for name, _ in group.consumers.values()),
            "per_channel": sorted(name for name, _ in group.per_channel.values()),
        }
        reason, channels = _check_group(group, cls._sparse_ids)
        record["channels"] = channels
        if reason is not None:
            record["skipped"] = reason
            cls._unpermuted_dims.append(f"{record['consumers']}: {reason}")
            if cls._verbosity >= 2:
                print(f"[ASP] not permuting the inputs of {record['consumers']}: {reason}")
            return record
        pruned = [
            m.weight for _, m in group.consumers.values() if cls._sparse_ids is None or id(m.weight) in cls._sparse_ids
        ]
        device = pruned[0].device
        matrix = torch.cat([as_matrix(w.detach()).to(device=device, dtype=torch.float32) for w in pruned])
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        permutation = None
        if not distributed or torch.distributed.get_rank() == 0:
            options = dict(cls._search_options) if cls._search_options else None
            permutation = accelerated_search_for_good_permutation(
                matrix, options, verbosity=max(cls._verbosity - 2, 0), seed=cls._identical_seed
            )
        if distributed:
            # rank 0 searches, every rank applies its result: the ranks' models stay identical
            # even where float sums on different devices could tip a search another way
            shared = [permutation]
            torch.distributed.broadcast_object_list(shared, src=0)
            permutation = shared[0]
        before = _ops.kept_magnitude(matrix)
        after = _ops.kept_magnitude(matrix[:, permutation])
        record.update(kept_before=before, kept_after=after)
        if after <= before:
            record["skipped"] = "the search found no better order"
            cls._unpermuted_dims.append(f"{record['consumers']}: {record['skipped']}")
            return record
        record["permutation"] = permutation
        with torch.no_grad():
            for module_name, module in group.consumers.values():
                if _permute_parameter(module, "weight", 1, permutation, optimizer):
                    cls._params_permuted_in_C.append(f"{module_name}.weight")
            for module_name, module in [*group.producers.values(), *group.per_channel.values()]:
                for name in ("weight", "bias", "running_mean", "running_var"):
                    if _permute_parameter(module, name, 0, permutation, optimizer):
                        cls._params_permuted_in_K.append(f"{module_name}.{name}")
        if cls._verbosity >= 2:
            print(
                f"[ASP] permuted the {channels} input channels of {record['consumers']}: kept magnitude "
                f"{before:.4g} -> {after:.4g}"
            )
        return record


def _permute_parameter(module, name: str, dim: int, permutation: list[int], optimizer) -> bool:
    """Reorder ``module.<name>`` along ``dim``, with ASP's buffers of it and its optimizer state;
    whether the module has such a tensor."""
    tensor = getattr(module, name, None)
    if not isinstance(tensor, torch.Tensor):
        return False
    related = [tensor]
    for buffer in (f"__{name}_mma_mask", f"__{name}_mma_pruned_p"):
        if module._buffers.get(buffer) is not None:
            related.append(module._buffers[buffer])
    if optimizer is not None and isinstance(tensor, torch.nn.Parameter):
        for value in optimizer.state.get(tensor, {}).values():
            if isinstance(value, torch.Tensor) and value.shape == tensor.shape:
                related.append(value)
    for t in related:
        index = torch.tensor(permutation, dtype=torch.int64, device=t.device)
        t.copy_(t.index_select(dim, index))
    return True


__all__ = ["Permutation", "PermutationWarning", "find_channel_groups"]
