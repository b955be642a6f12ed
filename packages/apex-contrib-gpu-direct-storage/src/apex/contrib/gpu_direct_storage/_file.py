"""``_GDSFile``: upstream's cuFile-backed file object, on ``torch.cuda.gds.GdsFile`` (modes ``r``/``w``) and plain
POSIX file I/O (modes ``rn``/``wn``)."""

from __future__ import annotations

import ctypes
import os

import torch

# mode: (what it is for, the method that needs it)
MODES = {
    "r": ("reading through GPUDirect Storage", "load_data"),
    "w": ("writing through GPUDirect Storage", "save_data"),
    "rn": ("reading without GPUDirect Storage", "load_data_no_gds"),
    "wn": ("writing without GPUDirect Storage", "save_data_no_gds"),
}
FILE_PERMISSIONS = 0o664  # of a file the write modes create (upstream's)


def gds_module():
    """``torch.cuda.gds``, or RuntimeError saying what this PyTorch lacks."""
    if torch.version.cuda is None:
        raise RuntimeError(
            f"GPUDirect Storage needs a PyTorch built with CUDA (this is torch {torch.__version__}, built without "
            "CUDA); modes 'rn' and 'wn' work without it"
        )
    try:
        import torch.cuda.gds as gds
    except ImportError as error:
        raise RuntimeError(f"GPUDirect Storage needs torch.cuda.gds, which torch {torch.__version__} lacks") from error
    return gds


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor, as a 1-d uint8 view of its memory."""
    return tensor.detach().view(-1).view(torch.uint8)


def _covers_its_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is exactly its storage (what torch.cuda.gds reads and writes whole)."""
    return tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.nbytes


class _GDSFile:
    """A file opened for one kind of tensor I/O, always at offset 0 of the file (as upstream).

    Modes: ``"r"`` / ``"w"`` for ``load_data`` / ``save_data`` (CUDA tensors, GPUDirect Storage through
    ``torch.cuda.gds``, the file opened with ``O_DIRECT``); ``"rn"`` / ``"wn"`` for ``load_data_no_gds`` /
    ``save_data_no_gds`` (CPU or CUDA tensors, plain reads and writes). Each method raises RuntimeError unless the
    file is open in its mode. A write mode creates the file (permissions 0664) and, as upstream, does not truncate it.

    Differs from upstream on purpose: ``open`` on an object made without arguments binds it to that filename and
    mode (upstream's never opens); tensors must be contiguous (upstream writes ``nbytes`` of raw memory of any
    tensor); a read needing more bytes than the file holds raises (upstream reads garbage through cuFile, and
    leaves the tensor unchanged on an empty file without GDS); the GDS paths synchronize the tensor's device first,
    since cuFile does not wait for work queued on CUDA streams.
    """

    def __init__(self, filename: str | None = None, mode: str | None = None):
        self.filename = None
        self.mode = None
        self.is_open = False
        self._fd: int | None = None  # modes rn, wn
        self._gds = None  # modes r, w: a torch.cuda.gds.GdsFile
        if filename is not None or mode is not None:
            if filename is None or mode is None:
                raise TypeError("_GDSFile: pass both filename and mode, or neither (and call open later)")
            self.open(filename, mode)

    def open(self, filename: str, mode: str) -> None:
        if not isinstance(filename, (str, os.PathLike)):
            raise TypeError(f"open: filename must be a str, got {type(filename).__name__}")
        if not isinstance(mode, str):
            raise TypeError(f"open: mode must be a str, got {type(mode).__name__}")
        filename = os.fspath(filename)
        if mode not in MODES:
            raise ValueError(f"open: mode must be one of 'r', 'w', 'rn', 'wn', got {mode!r}")
        if self.is_open:
            raise RuntimeError(f"open: {self.filename} is already open (mode {self.mode!r})")
        if self.filename is not None and (filename, mode) != (self.filename, self.mode):
            raise ValueError(
                f"open: this file object belongs to {self.filename!r} in mode {self.mode!r}; got filename "
                f"{filename!r}, mode {mode!r} (make a new one)"
            )
        if mode in ("r", "w"):
            gds = gds_module()
            if mode == "w":  # create it with upstream's permissions; GdsFile adds O_DIRECT
                os.close(os.open(filename, os.O_CREAT | os.O_WRONLY, FILE_PERMISSIONS))
            flags = os.O_RDONLY if mode == "r" else os.O_WRONLY
            try:
                self._gds = gds.GdsFile(filename, flags)
            except (RuntimeError, AttributeError) as error:  # AttributeError: a torch built without cuFile
                raise RuntimeError(f"open: cuFile cannot register {filename}: {error}") from error
        else:
            flags = os.O_RDONLY if mode == "rn" else os.O_CREAT | os.O_WRONLY
            self._fd = os.open(filename, flags, FILE_PERMISSIONS)
        self.filename, self.mode, self.is_open = filename, mode, True

    def close(self) -> None:
        """Deregister and close the file; closing a closed file does nothing (as upstream)."""
        if self._gds is not None:
            gds, self._gds = self._gds, None
            if gds.handle is not None:
                gds.deregister_handle()
            del gds  # GdsFile closes its descriptor when it goes
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
        self.is_open = False

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = f"mode {self.mode!r}" if self.is_open else "closed"
        return f"_GDSFile({self.filename!r}, {state})"

    # ------------------------------------------------------------------ checks

    def _check(self, method: str, mode: str, tensor, cuda: bool) -> None:
        if not self.is_open:
            raise RuntimeError(f"{method}: {self.filename or 'the file'} is not open")
        if self.mode != mode:
            raise RuntimeError(
                f"{method}: {self.filename} was opened with mode {self.mode!r} ({MODES[self.mode][0]}); "
                f"{method} needs mode {mode!r}"
            )
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{method}: tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if cuda and tensor.device.type != "cuda":
            raise ValueError(
                f"{method}: tensor must be a CUDA tensor for GPUDirect Storage, got one on {tensor.device}"
            )
        if tensor.layout != torch.strided or not tensor.is_contiguous():
            raise ValueError(
                f"{method}: tensor must be a dense contiguous tensor (its bytes go to the file as they are)"
            )

    def _check_file_holds(self, method: str, fd: int, nbytes: int) -> None:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise RuntimeError(f"{method}: {self.filename} holds {size} bytes; tensor needs {nbytes}")

    # ------------------------------------------------------------------ GPUDirect Storage (modes r, w)

    def load_data(self, tensor: torch.Tensor) -> None:
        """Read ``tensor.nbytes`` bytes from the start of the file into the CUDA tensor, through cuFile."""
        self._check("load_data", "r", tensor, cuda=True)
        nbytes = tensor.nbytes
        if nbytes == 0:
            return
        self._check_file_holds("load_data", self._gds.fd, nbytes)
        whole = _covers_its_storage(tensor)
        target = tensor if whole else torch.empty(nbytes, dtype=torch.uint8, device=tensor.device)
        with torch.cuda.device(tensor.device):
            torch.cuda.current_stream().synchronize()  # no queued kernel may still write the tensor
            self._gds.load_storage(target.untyped_storage(), 0)
        if not whole:
            with torch.no_grad():
                _byte_view(tensor).copy_(target)

    def save_data(self, tensor: torch.Tensor) -> None:
        """Write the CUDA tensor's bytes to the start of the file, through cuFile."""
        self._check("save_data", "w", tensor, cuda=True)
        if tensor.nbytes == 0:
            return
        source = tensor if _covers_its_storage(tensor) else tensor.detach().clone()
        with torch.cuda.device(tensor.device):
            torch.cuda.current_stream().synchronize()  # the tensor's values must be final before cuFile reads them
            self._gds.save_storage(source.untyped_storage(), 0)

    # ------------------------------------------------------------------ plain file I/O (modes rn, wn)

    def load_data_no_gds(self, tensor: torch.Tensor) -> None:
        """Read ``tensor.nbytes`` bytes from the start of the file into the tensor (CPU or CUDA)."""
        self._check("load_data_no_gds", "rn", tensor, cuda=False)
        nbytes = tensor.nbytes
        if nbytes == 0:
            return
        self._check_file_holds("load_data_no_gds", self._fd, nbytes)
        data = bytearray(nbytes)
        view, done = memoryview(data), 0
        while done < nbytes:
            read = os.preadv(self._fd, [view[done:]], done)
            if read == 0:
                raise RuntimeError(f"load_data_no_gds: {self.filename} ended after {done} of {nbytes} bytes")
            done += read
        with torch.no_grad():
            _byte_view(tensor).copy_(torch.frombuffer(data, dtype=torch.uint8))

    def save_data_no_gds(self, tensor: torch.Tensor) -> None:
        """Write the tensor's bytes (CPU or CUDA) to the start of the file."""
        self._check("save_data_no_gds", "wn", tensor, cuda=False)
        nbytes = tensor.nbytes
        if nbytes == 0:
            return
        host = _byte_view(tensor).cpu()  # waits for the tensor's stream
        data = memoryview(ctypes.string_at(host.data_ptr(), nbytes))
        done = 0
        while done < nbytes:
            done += os.pwrite(self._fd, data[done:], done)
