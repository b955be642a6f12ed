"""apex.contrib.nccl_allocator: on the CPU, the environment init sets, the errors without CUDA/NCCL, device
resolution, how ``symmetric`` reaches PyTorch and the order nccl_mem (de)registers its pool (against stand-ins for
PyTorch's pool and backend); marked gpu/multigpu, real NCCL pools and all-reduces of their buffers."""

from __future__ import annotations

import contextlib
import warnings

import _apex_nccl_allocator
import pytest
import torch

import apex.contrib.nccl_allocator as nccl_allocator
from apex.core.testing import run_ranks

NO_CUDA_BUILD = torch.version.cuda is None and getattr(torch.version, "hip", None) is None


# ---------------------------------------------------------------- CPU: import, errors, environment


def test_public_names():
    assert sorted(nccl_allocator.__all__) == ["create_nccl_mem_pool", "init", "nccl_mem"]
    assert callable(_apex_nccl_allocator.get_nccl_allocator)
    assert "get_nccl_allocator" in _apex_nccl_allocator.__all__


@pytest.mark.skipif(not NO_CUDA_BUILD, reason="checks the errors of a PyTorch built without CUDA")
@pytest.mark.parametrize(
    "name, call",
    [
        ("init", lambda: nccl_allocator.init()),
        ("create_nccl_mem_pool", lambda: nccl_allocator.create_nccl_mem_pool()),
        ("create_nccl_mem_pool", lambda: nccl_allocator.create_nccl_mem_pool(symmetric=True)),
        ("nccl_mem", lambda: nccl_allocator.nccl_mem(object())),
        ("get_nccl_allocator", lambda: _apex_nccl_allocator.get_nccl_allocator()),
    ],
)
def test_without_cuda_every_function_says_what_is_missing(name, call):
    with pytest.raises(RuntimeError, match=f"^{name}: apex.contrib.nccl_allocator needs a PyTorch built with CUDA"):
        call()


def test_disabled_nccl_mem_does_nothing():
    # As upstream: enabled=False is a no-op context on any machine, allocations stay where they were.
    with nccl_allocator.nccl_mem(None, enabled=False) as context:
        x = torch.ones(3)
    assert context.group is None and context.device is None
    assert x.sum().item() == 3


@pytest.fixture
def available(monkeypatch):
    """Pretend this PyTorch has CUDA, NCCL and a GPU, for the pure-Python parts."""
    monkeypatch.setattr(nccl_allocator, "_missing", lambda need_device: None)


def test_init_sets_nccls_environment(available, monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.delenv("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK", raising=False)
    nccl_allocator.init()
    import os

    assert os.environ["NCCL_NVLS_ENABLE"] == "1"
    assert os.environ["TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"] == "0"


def test_missing_names_what_lacks(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    assert "NCCL" in nccl_allocator._missing(need_device=False)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert nccl_allocator._missing(need_device=False) is None
    assert "a CUDA device" in nccl_allocator._missing(need_device=True)


@pytest.mark.parametrize(
    "requested, expected",
    [(None, "cuda:3"), (1, "cuda:1"), ("cuda:2", "cuda:2"), ("cuda", "cuda:3"), (torch.device("cuda", 0), "cuda:0")],
)
def test_device_resolution(monkeypatch, requested, expected):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert nccl_allocator._cuda_device("nccl_mem", requested) == torch.device(expected)


@pytest.mark.parametrize(
    "requested, error, message",
    [("cpu", ValueError, "device must be a CUDA device, got 'cpu'"), (1.5, TypeError, "device must be None, an int")],
)
def test_bad_device_raises_naming_the_argument(requested, error, message):
    with pytest.raises(error, match=r"^nccl_mem: " + message):
        nccl_allocator._cuda_device("nccl_mem", requested)


def test_allocator_needs_an_initialized_process_group(available):
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match=r"^create_nccl_mem_pool: needs torch.distributed initialized"):
        nccl_allocator._nccl_allocator("create_nccl_mem_pool", device=0)


def test_allocator_needs_an_nccl_backend(available, tmp_path):
    # A real (gloo, one rank) process group: its backend is not NCCL's.
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match=r"^get_nccl_allocator: the process group"):
            nccl_allocator._nccl_allocator("get_nccl_allocator", device=0)
        with pytest.raises(TypeError, match=r"^nccl_mem: group must be a torch.distributed.ProcessGroup"):
            nccl_allocator._nccl_backend("nccl_mem", object(), torch.device("cuda", 0))
    finally:
        torch.distributed.destroy_process_group()


class RefusingBackend:
    """ProcessGroupNCCL where PyTorch offers no NCCL memory allocator (torch 2.11 on a device without multicast)."""

    @property
    def mem_allocator(self):
        raise RuntimeError("NCCL mem allocator is not supported in this NCCL version")

    def supports_tensor_alloc(self, device):
        return False


def test_allocator_refused_by_pytorch_raises_saying_so(available, monkeypatch):
    monkeypatch.setattr(nccl_allocator, "_default_group", lambda function: "group")
    monkeypatch.setattr(nccl_allocator, "_nccl_backend", lambda function, group, device: RefusingBackend())
    expected = r"^get_nccl_allocator: PyTorch's NCCL backend offers no ncclMemAlloc allocator on cuda:0"
    with pytest.raises(RuntimeError, match=expected) as info:
        nccl_allocator._nccl_allocator("get_nccl_allocator", device=0)
    message = str(info.value)
    assert "not supported in this NCCL version" in message and "supports_tensor_alloc(cuda:0) is False" in message
    assert isinstance(info.value.__cause__, RuntimeError)


# ---------------------------------------------------------------- CPU: symmetric and registration, on stand-ins


class PoolWithSymmetric:
    def __init__(self, allocator, use_on_oom=False, symmetric=False):
        self.allocator, self.symmetric = allocator, symmetric


class PoolWithSymmMem:
    def __init__(self, allocator, use_on_oom=False, symm_mem=False):
        self.allocator, self.symmetric = allocator, symm_mem


class PlainPool:
    def __init__(self, allocator, use_on_oom=False, no_split=False):
        self.allocator = allocator


class Backend:
    """Records what nccl_mem asks of ProcessGroupNCCL; ``fail`` names methods that raise RuntimeError."""

    def __init__(self, log, fail=(), symm=True):
        self.log, self.fail = log, set(fail)
        if not symm:
            self.register_mem_pool = self._register_without_symm

    def deregister_mem_pool(self, pool):
        self.log.append("deregister")
        if "deregister" in self.fail:
            raise RuntimeError("not registered")

    def register_mem_pool(self, pool, symm=False):
        self.log.append(("register", symm))
        if "register" in self.fail:
            raise RuntimeError("NCCL error")

    def _register_without_symm(self, pool):
        self.log.append(("register", None))


@pytest.fixture
def fake_torch(available, monkeypatch):
    """torch.cuda.MemPool/use_mem_pool and the NCCL backend replaced by recorders; returns the log."""
    log = []
    monkeypatch.setattr(nccl_allocator, "_nccl_allocator", lambda function, group=None, device=None: "allocator")
    monkeypatch.setattr(torch.cuda, "MemPool", PlainPool)

    @contextlib.contextmanager
    def use_mem_pool(pool, device=None):
        log.append(("use pool", str(device)))
        try:
            yield
        finally:
            log.append("leave pool")

    monkeypatch.setattr(torch.cuda, "use_mem_pool", use_mem_pool)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return log


@pytest.mark.parametrize("pool_class", [PoolWithSymmetric, PoolWithSymmMem])
@pytest.mark.parametrize("symmetric", [True, False])
def test_symmetric_reaches_the_mem_pool(fake_torch, monkeypatch, pool_class, symmetric):
    monkeypatch.setattr(torch.cuda, "MemPool", pool_class)
    with pytest.warns(FutureWarning, match=r"deprecated"):
        pool = nccl_allocator.create_nccl_mem_pool(symmetric=symmetric)
    assert (pool.allocator, pool.symmetric) == ("allocator", symmetric)


def test_plain_pool_without_symmetric(fake_torch):
    with pytest.warns(FutureWarning):
        pool = nccl_allocator.create_nccl_mem_pool()
    assert isinstance(pool, PlainPool) and pool.allocator == "allocator"
    assert not hasattr(pool, nccl_allocator._SYMMETRIC_ATTRIBUTE)


def test_symmetric_without_support_raises_naming_the_argument(fake_torch, monkeypatch):
    monkeypatch.setattr(nccl_allocator, "_register_takes_symm", lambda: False)
    with warnings.catch_warnings(), pytest.raises(ValueError, match=r"^create_nccl_mem_pool: symmetric=True needs"):
        warnings.simplefilter("ignore", FutureWarning)
        nccl_allocator.create_nccl_mem_pool(symmetric=True)


def test_bad_symmetric_type_raises(fake_torch):
    with pytest.raises(TypeError, match=r"^create_nccl_mem_pool: symmetric must be None or a bool, got 'yes'"):
        nccl_allocator.create_nccl_mem_pool(symmetric="yes")


def make_nccl_mem(monkeypatch, log, symmetric=None, **backend_kwargs):
    monkeypatch.setattr(nccl_allocator, "_register_takes_symm", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        pool = nccl_allocator.create_nccl_mem_pool(symmetric=symmetric)
    backend = Backend(log, **backend_kwargs)
    monkeypatch.setattr(nccl_allocator, "_nccl_backend", lambda function, group, device: backend)
    return nccl_allocator.nccl_mem(pool, device=1, group="group")


def test_nccl_mem_deregisters_on_entry_and_registers_on_exit(fake_torch, monkeypatch):
    context = make_nccl_mem(monkeypatch, fake_torch)
    assert fake_torch == []  # nothing happens before entry
    with context:
        assert fake_torch == [("use pool", "cuda:1"), "deregister"]
    assert fake_torch[2:] == [("register", False), "leave pool"]


def test_nccl_mem_registers_symmetric_where_registration_takes_it(fake_torch, monkeypatch):
    with make_nccl_mem(monkeypatch, fake_torch, symmetric=True):
        pass
    assert ("register", True) in fake_torch


def test_nccl_mem_ignores_deregistering_a_new_pool_and_warns_when_registration_fails(fake_torch, monkeypatch):
    with pytest.warns(RuntimeWarning, match=r"^nccl_mem: registering the pool"):
        with make_nccl_mem(monkeypatch, fake_torch, fail=("deregister", "register")):
            pass
    assert fake_torch[-1] == "leave pool"  # the pool context is left even so


def test_nccl_mem_leaves_the_pool_when_the_body_raises(fake_torch, monkeypatch):
    with pytest.raises(KeyError), make_nccl_mem(monkeypatch, fake_torch):
        raise KeyError("body")
    assert fake_torch[-2:] == [("register", False), "leave pool"]


def test_nccl_mem_rejects_what_is_not_a_pool(fake_torch):
    with pytest.raises(TypeError, match=r"^nccl_mem: pool must be a torch.cuda.MemPool, got str"):
        nccl_allocator.nccl_mem("pool", device=0, group="group")


# ---------------------------------------------------------------- GPU: real NCCL pools (run by run_ranks)
#
# Whether PyTorch's NCCL backend offers its ncclMemAlloc allocator depends on the machine: PyTorch refuses
# (ProcessGroupNCCL.mem_allocator raises RuntimeError) unless NCCL has ncclMemAlloc and, by its own check, the
# device supports CUDA multicast. Each worker asks PyTorch directly, not through the package; where it is
# offered, the pool tests run; where it is not, the package's functions must say so clearly. (None of these
# call nccl_allocator.init(): it would turn NCCL's NVLink SHARP on, which the test machines keep off.)


def _torch_refuses_nccl_mem_alloc() -> str | None:
    """PyTorch's reason for offering no NCCL memory allocator on the current device, or None where it offers one."""
    device = torch.device("cuda", torch.cuda.current_device())
    backend = torch.distributed.group.WORLD._get_backend(device)
    try:
        _ = backend.mem_allocator
    except RuntimeError as error:
        return str(error) or type(error).__name__
    return None


def _refusals() -> dict[str, str]:
    """The errors of the package's allocator functions, on a machine where PyTorch offers no allocator."""
    out = {}
    for name, call in (
        ("create_nccl_mem_pool", nccl_allocator.create_nccl_mem_pool),
        ("get_nccl_allocator", _apex_nccl_allocator.get_nccl_allocator),
    ):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                call()
            out[name] = "no error"
        except Exception as error:  # the test checks the type and the message
            out[name] = f"{type(error).__name__}: {error}"
    return out


def _allocate_in_pool(rank, world_size):
    """One rank: a pool from ProcessGroupNCCL's allocator; a tensor made under nccl_mem lives in it."""
    refused = _torch_refuses_nccl_mem_alloc()
    if refused is not None:
        return dict(refused=refused, errors=_refusals())
    pool = nccl_allocator.create_nccl_mem_pool()
    assert isinstance(pool, torch.cuda.MemPool)
    with nccl_allocator.nccl_mem(pool):
        x = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    outside = torch.empty(1 << 20, device="cuda")
    segments = [(s["address"], s["address"] + s["total_size"]) for s in pool.snapshot()]
    in_pool = [any(lo <= t.data_ptr() < hi for lo, hi in segments) for t in (x, outside)]
    torch.distributed.all_reduce(x)
    torch.cuda.synchronize()
    legacy = _apex_nccl_allocator.get_nccl_allocator()
    return dict(refused=None, in_pool=in_pool, x=x.cpu(), legacy=legacy is not None)


@pytest.fixture(scope="module")
def one_rank_pool():
    (out,) = run_ranks(__file__, "_allocate_in_pool", 1, backend="nccl")
    return out


def _skip_without_nccl_mem_alloc(out):
    if out["refused"] is not None:
        pytest.skip(
            "needs PyTorch's NCCL memory allocator (ProcessGroupNCCL.mem_allocator: NCCL with ncclMemAlloc and a "
            f"device with CUDA multicast support), which this machine lacks: {out['refused']}"
        )


@pytest.mark.gpu
def test_pool_allocates_in_ncclmemalloc_memory(one_rank_pool):
    _skip_without_nccl_mem_alloc(one_rank_pool)
    assert one_rank_pool["in_pool"] == [True, False]
    torch.testing.assert_close(one_rank_pool["x"], torch.arange(1 << 20, dtype=torch.float32), rtol=0, atol=0)
    assert one_rank_pool["legacy"]


@pytest.mark.gpu
def test_without_nccl_mem_alloc_the_allocator_functions_say_so(one_rank_pool):
    if one_rank_pool["refused"] is None:
        pytest.skip("PyTorch offers its NCCL memory allocator here: the refusal path is not reachable")
    for name, error in one_rank_pool["errors"].items():
        assert error.startswith(f"RuntimeError: {name}: PyTorch's NCCL backend offers no ncclMemAlloc allocator on "), (
            error
        )
        assert one_rank_pool["refused"].splitlines()[0] in error, "the error must carry PyTorch's reason"


def _rank_data(rank, size):
    generator = torch.Generator().manual_seed(1234 + rank)
    return torch.randn(size, generator=generator, dtype=torch.float64).float()


def _all_reduce_pool_and_plain(rank, world_size):
    refused = _torch_refuses_nccl_mem_alloc()
    if refused is not None:
        return dict(refused=refused)
    sizes = [1, 7, 4097, 1 << 22]
    pool = nccl_allocator.create_nccl_mem_pool()
    with nccl_allocator.nccl_mem(pool):
        pooled = [_rank_data(rank, n).cuda() for n in sizes]
    plain = [_rank_data(rank, n).cuda() for n in sizes]
    for p, q in zip(pooled, plain):
        torch.distributed.all_reduce(p)
        torch.distributed.all_reduce(q)
    torch.cuda.synchronize()
    return dict(refused=None, pooled=[p.cpu() for p in pooled], plain=[q.cpu() for q in plain], sizes=sizes)


@pytest.mark.multigpu
def test_all_reduce_of_pool_tensors_matches_a_plain_one():
    results = run_ranks(__file__, "_all_reduce_pool_and_plain", 2, backend="nccl")
    for out in results:
        _skip_without_nccl_mem_alloc(out)
    for out in results:
        for p, q, n in zip(out["pooled"], out["plain"], out["sizes"]):
            expected = sum(_rank_data(r, n).double() for r in range(2))
            torch.testing.assert_close(p.double(), expected, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
