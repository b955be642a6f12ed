"""apex.contrib.gpu_direct_storage: round trips of tensors through files (plain I/O on the CPU and CUDA, GPUDirect
Storage marked gpu), the bytes in the file read back independently, bad modes, closed files, the deprecation
warning and upstream's legacy module."""

from __future__ import annotations

import warnings

import _apex_gpu_direct_storage
import pytest
import torch

from apex.contrib.gpu_direct_storage import GDSFile, _GDSFile

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int8, torch.bool]
SHAPES = [(), (0,), (1,), (7,), (3, 5, 7), (1000, 33)]


def random_tensor(shape, dtype):
    if dtype == torch.bool:
        return torch.rand(shape) < 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=torch.float64).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, dtype=dtype)


def different_from(x):
    """A tensor like ``x`` differing from it in every element (so a load that does nothing fails)."""
    return x.logical_not() if x.dtype == torch.bool else torch.where(x == 0, torch.ones_like(x), torch.zeros_like(x))


def file_as_tensor(path, like):
    """The file's bytes as a tensor like ``like``, read without the code under test."""
    data = path.read_bytes()
    assert len(data) == like.nbytes
    if not data:
        return torch.empty(like.shape, dtype=like.dtype)
    return torch.frombuffer(bytearray(data), dtype=like.dtype).reshape(like.shape)


@pytest.fixture(autouse=True)
def _quiet_deprecation():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


# ---------------------------------------------------------------- plain I/O: CPU and CUDA


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_no_gds_round_trip(device, tmp_path, dtype, shape):
    path = tmp_path / "t.bin"
    x = random_tensor(shape, dtype).to(device)
    with GDSFile(str(path), "wn") as f:
        f.save_data_no_gds(x)
    assert torch.equal(file_as_tensor(path, x), x.cpu())
    y = different_from(x)
    with GDSFile(str(path), "rn") as f:
        f.load_data_no_gds(y)
    assert torch.equal(y, x)


def test_no_gds_views_touch_only_their_bytes(device, tmp_path):
    path = str(tmp_path / "t.bin")
    big = torch.randn(100, device=device)
    with GDSFile(path, "wn") as f:
        f.save_data_no_gds(big[10:37])  # a view 10 elements into its storage
    target = torch.full((100,), -5.0, device=device)
    with GDSFile(path, "rn") as f:
        f.load_data_no_gds(target[50:77])
    assert torch.equal(target[50:77], big[10:37])
    assert (target[:50] == -5).all() and (target[77:] == -5).all()


def test_no_gds_loads_into_a_leaf_that_requires_grad(tmp_path):
    path = str(tmp_path / "t.bin")
    x = torch.randn(5, 3)
    with GDSFile(path, "wn") as f:
        f.save_data_no_gds(x)
    weight = torch.zeros(5, 3, requires_grad=True)
    with GDSFile(path, "rn") as f:
        f.load_data_no_gds(weight)
    assert torch.equal(weight.detach(), x) and weight.requires_grad


def test_write_mode_overwrites_from_the_start_without_truncating(tmp_path):
    # As upstream (O_CREAT | O_WRONLY, offset 0): a shorter tensor leaves the file's tail.
    path = tmp_path / "t.bin"
    with GDSFile(str(path), "wn") as f:
        f.save_data_no_gds(torch.arange(10, dtype=torch.int32))
    with GDSFile(str(path), "wn") as f:
        f.save_data_no_gds(torch.full((4,), -1, dtype=torch.int32))
    expected = torch.tensor([-1, -1, -1, -1, 4, 5, 6, 7, 8, 9], dtype=torch.int32)
    assert torch.equal(file_as_tensor(path, expected), expected)


# ---------------------------------------------------------------- errors


def test_bad_mode_raises_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"^open: mode must be one of 'r', 'w', 'rn', 'wn', got 'rw'"):
        _GDSFile(str(tmp_path / "t.bin"), "rw")
    with pytest.raises(TypeError, match=r"^GDSFile: filename must be a str, got int"):
        with GDSFile(3, "r"):
            pass
    with pytest.raises(TypeError, match=r"^GDSFile: mode must be a str, got NoneType"):
        with GDSFile("x", None):
            pass


@pytest.mark.parametrize(
    "opened, method",
    [("wn", "load_data_no_gds"), ("rn", "save_data_no_gds")],
)
def test_method_in_the_wrong_mode_raises(tmp_path, opened, method):
    path = tmp_path / "t.bin"
    path.write_bytes(bytes(64))
    needed = "rn" if opened == "wn" else "wn"
    with GDSFile(str(path), opened) as f:
        with pytest.raises(RuntimeError, match=f"^{method}: .* was opened with mode '{opened}'.*needs mode '{needed}'"):
            getattr(f, method)(torch.zeros(4))


def test_closed_file_raises(tmp_path):
    path = str(tmp_path / "t.bin")
    with GDSFile(path, "wn") as f:
        pass
    assert not f.is_open
    with pytest.raises(RuntimeError, match=r"^save_data_no_gds: .*t.bin is not open"):
        f.save_data_no_gds(torch.zeros(2))
    f.close()  # closing again does nothing, as upstream


def test_file_is_closed_when_the_block_raises(tmp_path):
    with pytest.raises(KeyError), GDSFile(str(tmp_path / "t.bin"), "wn") as f:
        raise KeyError("body")
    assert not f.is_open


def test_reading_more_than_the_file_holds_raises(tmp_path):
    path = tmp_path / "t.bin"
    path.write_bytes(bytes(10))
    with GDSFile(str(path), "rn") as f, pytest.raises(RuntimeError, match=r"holds 10 bytes; tensor needs 16"):
        f.load_data_no_gds(torch.zeros(4))


def test_bad_tensors_raise_naming_the_argument(tmp_path):
    with GDSFile(str(tmp_path / "t.bin"), "wn") as f:
        with pytest.raises(ValueError, match=r"^save_data_no_gds: tensor must be a dense contiguous tensor"):
            f.save_data_no_gds(torch.zeros(4, 6).t())
        with pytest.raises(TypeError, match=r"^save_data_no_gds: tensor must be a torch.Tensor, got list"):
            f.save_data_no_gds([1.0])


def test_open_twice_and_reuse(tmp_path):
    path = str(tmp_path / "t.bin")
    f = _GDSFile()
    f.open(path, "wn")
    with pytest.raises(RuntimeError, match=r"^open: .* is already open"):
        f.open(path, "wn")
    f.close()
    f.open(path, "wn")  # the same file and mode again: fine
    f.close()
    with pytest.raises(ValueError, match=r"^open: this file object belongs to"):
        f.open(path, "rn")
    with pytest.raises(TypeError, match=r"pass both filename and mode"):
        _GDSFile(path)


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the error of a PyTorch built without CUDA")
@pytest.mark.parametrize("mode", ["r", "w"])
def test_gds_modes_without_cuda_say_what_is_missing(tmp_path, mode):
    path = tmp_path / "t.bin"
    path.write_bytes(bytes(8))
    with pytest.raises(RuntimeError, match=r"^GPUDirect Storage needs a PyTorch built with CUDA"):
        _GDSFile(str(path), mode)


# ---------------------------------------------------------------- deprecation, legacy module


def test_gdsfile_warns_deprecated(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with GDSFile(str(tmp_path / "t.bin"), "wn"):
            pass
    (warning,) = [w for w in caught if issubclass(w.category, FutureWarning)]
    assert "deprecated" in str(warning.message) and "torch.cuda.gds" in str(warning.message)
    assert warning.filename == __file__  # points at the caller


def test_legacy_module(tmp_path):
    assert _apex_gpu_direct_storage._GDSFile is _GDSFile
    path = str(tmp_path / "t.bin")
    x = torch.arange(12, dtype=torch.float32)
    f = _apex_gpu_direct_storage._GDSFile(path, "wn")
    f.save_data_no_gds(x)
    f.close()
    y = torch.empty(12)
    f = _apex_gpu_direct_storage._GDSFile(path, "rn")
    f.load_data_no_gds(y)
    f.close()
    assert torch.equal(x, y)


# ---------------------------------------------------------------- GPUDirect Storage (CUDA, cuFile)


@pytest.fixture
def gds_path(tmp_path):
    """A file cuFile can register, or a skip saying why not (no cuFile, or a filesystem without O_DIRECT)."""
    path = tmp_path / "gds.bin"
    try:
        probe = _GDSFile(str(path), "w")
        probe.save_data(torch.ones(1024, device="cuda"))
        probe.close()
    except (RuntimeError, OSError) as error:
        pytest.skip(f"cuFile is not usable on {tmp_path}: {error}")
    return str(path)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gds_round_trip(gds_path, dtype, shape):
    x = random_tensor(shape, dtype).cuda()
    with GDSFile(gds_path, "w") as f:
        f.save_data(x)
    assert torch.equal(file_as_tensor_prefix(gds_path, x), x.cpu())
    y = different_from(x)
    with GDSFile(gds_path, "r") as f:
        f.load_data(y)
    assert torch.equal(y, x)


def file_as_tensor_prefix(path, like):
    """The first ``like.nbytes`` bytes of the file (the probe left 4 KiB there) as a tensor like ``like``."""
    with open(path, "rb") as f:
        data = f.read(like.nbytes)
    if not data:
        return torch.empty(like.shape, dtype=like.dtype)
    return torch.frombuffer(bytearray(data), dtype=like.dtype).reshape(like.shape)


@pytest.mark.gpu
def test_gds_views_and_a_tensor_written_by_a_kernel(gds_path):
    big = torch.randn(1 << 20, device="cuda")
    source = (big * 3)[1000 : 1000 + 4097]  # a view 1000 elements in, computed on the stream just before the write
    with GDSFile(gds_path, "w") as f:
        f.save_data(source)
    target = torch.full((1 << 16,), -5.0, device="cuda")
    with GDSFile(gds_path, "r") as f:
        f.load_data(target[7 : 7 + 4097])
    assert torch.equal(target[7 : 7 + 4097], source)
    assert (target[:7] == -5).all() and (target[7 + 4097 :] == -5).all()


@pytest.mark.gpu
def test_gds_and_plain_files_are_the_same_bytes(gds_path):
    x = torch.randn(3, 1000, device="cuda", dtype=torch.bfloat16)
    with GDSFile(gds_path, "w") as f:
        f.save_data(x)
    y = torch.empty_like(x, device="cpu")
    with GDSFile(gds_path, "rn") as f:
        f.load_data_no_gds(y)
    assert torch.equal(y, x.cpu())


@pytest.mark.gpu
def test_gds_needs_a_cuda_tensor(gds_path):
    with GDSFile(gds_path, "w") as f, pytest.raises(ValueError, match=r"^save_data: tensor must be a CUDA tensor"):
        f.save_data(torch.zeros(4))
