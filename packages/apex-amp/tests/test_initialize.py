"""amp.initialize: the O0-O3 presets, overrides and their errors, argument forms, the plugin."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from apex import amp
from apex.fp16_utils import FP16_Optimizer

# The option values of upstream Apex's documented presets.
PRESETS = {
    "O0": dict(
        cast_model_type=torch.float32,
        patch_torch_functions=False,
        keep_batchnorm_fp32=None,
        master_weights=False,
        loss_scale=1.0,
    ),
    "O1": dict(
        cast_model_type=None,
        patch_torch_functions=True,
        keep_batchnorm_fp32=None,
        master_weights=None,
        loss_scale="dynamic",
    ),
    "O2": dict(
        cast_model_type=torch.float16,
        patch_torch_functions=False,
        keep_batchnorm_fp32=True,
        master_weights=True,
        loss_scale="dynamic",
    ),
    "O3": dict(
        cast_model_type=torch.float16,
        patch_torch_functions=False,
        keep_batchnorm_fp32=False,
        master_weights=False,
        loss_scale=1.0,
    ),
}


def init(net, opt=None, **kwargs):
    kwargs.setdefault("verbosity", 0)
    return amp.initialize(net, opt, **kwargs)


@pytest.mark.parametrize("level", sorted(PRESETS))
def test_presets(level, make_net):
    net = make_net()
    init(net, torch.optim.SGD(net.parameters(), lr=0.1), opt_level=level)
    props = amp._amp_state.opt_properties
    assert props.enabled is True and props.opt_level == level
    for name, expected in PRESETS[level].items():
        assert getattr(props, name) == expected, name
    assert props.autocast_dtype == (torch.float16 if level == "O1" else None)
    scalers = amp._amp_state.loss_scalers
    assert len(scalers) == 1
    assert scalers[0].dynamic == (PRESETS[level]["loss_scale"] == "dynamic")
    assert scalers[0].loss_scale() == (2.0**16 if scalers[0].dynamic else 1.0)


def test_presets_print_at_verbosity_1(make_net, capsys):
    net = make_net()
    amp.initialize(net, opt_level="O2", verbosity=1)
    out = capsys.readouterr().out
    assert "Selected optimization level O2" in out
    assert "After processing overrides" in out
    assert "keep_batchnorm_fp32    : True" in out


@pytest.mark.parametrize("level", ["O4", "00", "o1", "O", ""])
def test_unknown_level(level, make_net):
    with pytest.raises(RuntimeError, match=r"Unexpected optimization level .*the prefix O is the letter O"):
        init(make_net(), opt_level=level)


@pytest.mark.parametrize(
    ("level", "overrides", "message"),
    [
        ("O2", dict(patch_torch_functions=True), "patch_torch_functions=True should only be set by selecting"),
        ("O0", dict(patch_torch_functions=True), "patch_torch_functions=True should only be set by selecting"),
        ("O1", dict(cast_model_type=torch.float16), "O1 inserts casts around Torch functions"),
        ("O1", dict(cast_model_type=torch.bfloat16), "O1 inserts casts around Torch functions"),
        ("O1", dict(keep_batchnorm_fp32=True), "keep_batchnorm_fp32 should be None"),
        ("O1", dict(master_weights=True), "doesn't make sense to use master_weights with O1"),
        ("O2", dict(autocast_dtype=torch.bfloat16), "use cast_model_type"),
    ],
)
def test_inconsistent_overrides_raise(level, overrides, message, make_net):
    with pytest.raises(RuntimeError, match=message):
        init(make_net(), opt_level=level, **overrides)


def test_hard_override_turns_errors_into_warnings(make_net):
    amp._amp_state.hard_override = True
    net = make_net()
    with pytest.warns(UserWarning, match="should only be set by selecting"):
        init(net, opt_level="O2", patch_torch_functions=True, cast_model_type=torch.bfloat16)
    assert amp._amp_state.opt_properties.patch_torch_functions is True


def test_consistent_overrides_apply(make_net):
    net = make_net()
    init(net, opt_level="O1", cast_model_type=torch.float32, patch_torch_functions=False)
    props = amp._amp_state.opt_properties
    assert props.cast_model_type is torch.float32 and props.patch_torch_functions is False
    net = make_net()
    init(net, opt_level="O2", keep_batchnorm_fp32="False", master_weights=False, loss_scale="128")
    props = amp._amp_state.opt_properties
    assert props.keep_batchnorm_fp32 is False and props.master_weights is False and props.loss_scale == 128.0
    assert not amp._amp_state.loss_scalers[0].dynamic and amp._amp_state.loss_scalers[0].loss_scale() == 128.0
    assert net.bn.weight.dtype == torch.float16  # keep_batchnorm_fp32=False casts batch norm too


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (dict(keep_batchnorm_fp32="yes"), ValueError),
        (dict(cast_model_type=torch.int8), TypeError),
        (dict(loss_scale=-1.0), ValueError),
        (dict(loss_scale="huge"), ValueError),
    ],
)
def test_bad_option_values(overrides, error, make_net):
    with pytest.raises(error):
        init(make_net(), opt_level="O2", **overrides)


@pytest.mark.parametrize(
    ("level", "overrides", "expected"),
    [
        ("O2", dict(cast_model_type=torch.bfloat16), 1.0),
        ("O1", dict(autocast_dtype=torch.bfloat16), 1.0),
        ("O2", dict(cast_model_type=torch.bfloat16, loss_scale="dynamic"), "dynamic"),
        ("O2", dict(), "dynamic"),
        ("O1", dict(), "dynamic"),
        ("O3", dict(cast_model_type=torch.bfloat16), 1.0),
    ],
)
def test_bf16_loss_scale_default(level, overrides, expected, make_net):
    init(make_net(), opt_level=level, **overrides)
    assert amp._amp_state.opt_properties.loss_scale == expected


def test_loss_scale_limits(make_net):
    init(make_net(), opt_level="O2", min_loss_scale=4.0, max_loss_scale=2.0**10, hysteresis=3, num_losses=2)
    for scaler in amp._amp_state.loss_scalers:
        assert scaler.loss_scale() == 2.0**10  # the initial 2**16 is clamped by max_loss_scale
        assert (scaler.min_loss_scale, scaler.max_loss_scale, scaler.hysteresis) == (4.0, 2.0**10, 3)
    assert len(amp._amp_state.loss_scalers) == 2


def test_parallel_wrapped_models_are_refused(make_net):
    with pytest.raises(RuntimeError, match=r"DataParallel. Parallel wrappers should only be applied"):
        init(nn.DataParallel(make_net()), opt_level="O1")
    # An instance is enough for the type check; building a real one needs a process group.
    ddp = nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel)
    with pytest.raises(RuntimeError, match=r"instance of torch.nn.parallel.DistributedDataParallel"):
        init([make_net(), ddp], opt_level="O1")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_models_are_refused(dtype, make_net):
    with pytest.raises(RuntimeError, match=r"you do not need to call .half"):
        init(make_net().to(dtype), opt_level="O2")
    amp._amp_state.allow_incoming_model_not_fp32 = True
    init(make_net().to(dtype), opt_level="O2")


def test_argument_forms(make_net):
    a = make_net()
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    model, opt = init(a, opt_a, opt_level="O1")
    assert model is a and opt is opt_a
    single = make_net()
    assert init(single, opt_level="O1") is single
    models = [make_net(), make_net()]
    assert init(models, opt_level="O1") is models
    c, d = make_net(), make_net()
    opt_c = torch.optim.SGD(c.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(d.parameters(), lr=0.1)
    models, opts = init([c, d], [opt_c, opt_d], opt_level="O1")
    assert models[0] is c and models[1] is d and opts == [opt_c, opt_d]
    e = make_net()
    opt_e = torch.optim.SGD(e.parameters(), lr=0.1)
    model, opts = init(e, [opt_e], opt_level="O1")
    assert model is e and opts == [opt_e]
    f = make_net()
    opt_f = torch.optim.SGD(f.parameters(), lr=0.1)
    models, opt = init([f], opt_f, opt_level="O1")
    assert models == [f] and opt is opt_f


def test_bad_argument_types(make_net):
    with pytest.raises(TypeError, match="models must be either a single model or a list of models"):
        init("model", opt_level="O1")
    with pytest.raises(TypeError, match="optimizers must be either a single optimizer or a list of optimizers"):
        init(make_net(), "optimizer", opt_level="O1")
    net = make_net()
    wrapped = FP16_Optimizer(torch.optim.SGD(net.parameters(), lr=0.1), verbose=False)
    with pytest.raises(RuntimeError, match=r"instance of apex.fp16_utils.FP16_Optimizer"):
        init(net, wrapped, opt_level="O1")
    with pytest.raises(RuntimeError, match=r"instance of apex.fp16_utils.FP16_Optimizer"):
        init(net, [wrapped], opt_level="O1")


def test_optimizer_only_once(make_net):
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    init(net, opt, opt_level="O1")
    with pytest.raises(RuntimeError, match=r"should only be passed through amp.initialize once"):
        init(make_net(), opt, opt_level="O1")


def test_disabled_is_a_no_op(make_net):
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, optimizer = init(net, opt, enabled=False, opt_level="O2")
    assert model is net and optimizer is opt
    assert all(p.dtype == torch.float32 for p in net.parameters())
    assert not hasattr(opt, "_amp_stash")
    loss = net(torch.randn(4, 8)).sum()
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled is loss


def test_scale_loss_needs_initialize(make_net, monkeypatch):
    monkeypatch.setattr(amp._amp_state, "opt_properties", None)
    loss = torch.ones((), requires_grad=True)
    with pytest.raises(RuntimeError, match="internal Amp state has not been initialized"):
        with amp.scale_loss(loss, torch.optim.SGD([loss], lr=0.1)):
            pass


def test_scale_loss_argument_errors(make_net):
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    init(net, opt, opt_level="O1")
    loss = net(torch.randn(4, 8)).sum()
    with pytest.raises(RuntimeError, match="num_losses=1"):
        with amp.scale_loss(loss, opt, loss_id=1):
            pass
    other = torch.optim.SGD(make_net().parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="did not process"):
        with amp.scale_loss(loss, other):
            pass


def test_plugin_is_discovered():
    from apex.core import plugins

    record = plugins.get("amp")
    assert record.error is None, record.error
    assert record.plugin.distribution == "apex-amp"
    assert record.plugin.provides == ("apex.amp", "apex.fp16_utils")
    assert record.plugin.kernel_library is None
