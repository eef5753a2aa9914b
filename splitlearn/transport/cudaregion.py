"""A GPU memory region two processes of one host share: the ``unix://`` transport's device region.

A ``unix://`` client whose tensors are on a CUDA device allocates one region per connection
with CUDA's virtual memory API (``cuMemCreate``), exports it as a POSIX file descriptor
(``cuMemExportToShareableHandle``) and passes that descriptor beside its host region in the
HELLO frame (``SCM_RIGHTS``); the server imports and maps it once for the connection's life
(``cuMemImportFromShareableHandle``, ``cuMemMap``). A tensor then crosses as one device-to-device
copy each way, never through host memory, and nothing is opened per call.

Why a descriptor and not ``cudaIpcGetMemHandle`` (what ``torch.multiprocessing`` uses): an IPC
handle is 64 bytes anyone who learns them can open, so a tenant who guessed another's handle
could read its region; a descriptor exists only in the processes it was passed to, as the host
region's memfd. The server maps only regions on its own device (same UUID), of a size that is a
multiple of the allocation granularity and at most its bound; an import or a map the driver
refuses is a 400. The driver holds the memory until both processes have unmapped it, so a client
that frees its region mid-request cannot make the server touch freed memory.

Written by hand with ``ctypes``: PyTorch exposes no virtual memory API and ``cuda-python`` is not a
dependency. Tested only where a GPU is present (``tests/test_transport_cuda.py``).
"""
from __future__ import annotations

import ctypes
import threading
from typing import Optional

import torch

_POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
_ON_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_READ_WRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class CudaError(RuntimeError):
    """The driver refused a call (its error name in the message)."""


_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None


def _driver() -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is None:
            lib = ctypes.CDLL("libcuda.so.1")
            u64, sz = ctypes.c_ulonglong, ctypes.c_size_t
            for name, args in {
                "cuInit": [ctypes.c_uint], "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
                "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int],
                "cuCtxSetCurrent": [ctypes.c_void_p],
                "cuMemGetAllocationGranularity": [ctypes.POINTER(sz), ctypes.POINTER(_Prop), ctypes.c_int],
                "cuMemCreate": [ctypes.POINTER(u64), sz, ctypes.POINTER(_Prop), u64],
                "cuMemExportToShareableHandle": [ctypes.c_void_p, u64, ctypes.c_int, u64],
                "cuMemImportFromShareableHandle": [ctypes.POINTER(u64), ctypes.c_void_p, ctypes.c_int],
                "cuMemGetAllocationPropertiesFromHandle": [ctypes.POINTER(_Prop), u64],
                "cuMemAddressReserve": [ctypes.POINTER(u64), sz, sz, u64, u64],
                "cuMemMap": [u64, sz, sz, u64, u64],
                "cuMemSetAccess": [u64, sz, ctypes.POINTER(_Access), sz],
                "cuMemUnmap": [u64, sz], "cuMemAddressFree": [u64, sz], "cuMemRelease": [u64],
                "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
            }.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, ctypes.c_int
            _lib = lib
    return _lib


def _check(result: int, what: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(result, ctypes.byref(name))
        raise CudaError(f"{what}: {(name.value or b'CUDA error').decode()} ({result})")


def _prop(ordinal: int) -> _Prop:
    p = _Prop()
    p.type, p.requestedHandleTypes = _PINNED, _POSIX_FD
    p.location.type, p.location.id = _ON_DEVICE, ordinal
    return p


def _current(ordinal: int) -> None:
    """Make the device's primary context (PyTorch's) current on this thread."""
    lib = _driver()
    _check(lib.cuInit(0), "cuInit")
    ctx = ctypes.c_void_p()
    _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), ordinal), "cuDevicePrimaryCtxRetain")
    _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def granularity(ordinal: int) -> int:
    g = ctypes.c_size_t()
    _check(_driver().cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(_prop(ordinal)), 0),
           "cuMemGetAllocationGranularity")
    return g.value


def uuid(device: torch.device) -> str:
    """The device's UUID: what two processes compare (their ordinals may differ)."""
    return str(torch.cuda.get_device_properties(device).uuid)


class _Mapped:
    """What ``torch.as_tensor`` reads a device pointer from (``__cuda_array_interface__``)."""

    def __init__(self, ptr: int, size: int):
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


class DeviceRegion:
    """``size`` bytes of GPU memory mapped in this process: :attr:`tensor` (uint8, on ``device``)
    views it. :meth:`create` a region (and its descriptor to pass), or :meth:`open` one received."""

    def __init__(self, handle: int, ptr: int, size: int, device: torch.device):
        self.handle, self.ptr, self.size, self.device = handle, ptr, size, device
        self.tensor = torch.as_tensor(_Mapped(ptr, size), device=device)

    @classmethod
    def _map(cls, handle: int, size: int, ordinal: int) -> "DeviceRegion":
        lib, ptr = _driver(), ctypes.c_ulonglong()
        _check(lib.cuMemAddressReserve(ctypes.byref(ptr), size, 0, 0, 0), "cuMemAddressReserve")
        try:
            _check(lib.cuMemMap(ptr.value, size, 0, handle, 0), "cuMemMap")
            access = _Access()
            access.location.type, access.location.id, access.flags = _ON_DEVICE, ordinal, _READ_WRITE
            try:
                _check(lib.cuMemSetAccess(ptr.value, size, ctypes.byref(access), 1), "cuMemSetAccess")
            except CudaError:
                lib.cuMemUnmap(ptr.value, size)
                raise
        except CudaError:
            lib.cuMemAddressFree(ptr.value, size)
            raise
        return cls(handle, ptr.value, size, torch.device("cuda", ordinal))

    @classmethod
    def create(cls, device: torch.device, size: int) -> tuple["DeviceRegion", int]:
        """A new region of at least ``size`` bytes (rounded up to the granularity) and the file
        descriptor that shares it (the caller passes it on and closes it)."""
        ordinal = torch.device(device).index if torch.device(device).index is not None else torch.cuda.current_device()
        _current(ordinal)
        lib, g = _driver(), granularity(ordinal)
        size = -(-size // g) * g
        handle = ctypes.c_ulonglong()
        _check(lib.cuMemCreate(ctypes.byref(handle), size, ctypes.byref(_prop(ordinal)), 0), "cuMemCreate")
        try:
            fd = ctypes.c_int(-1)
            _check(lib.cuMemExportToShareableHandle(ctypes.byref(fd), handle.value, _POSIX_FD, 0),
                   "cuMemExportToShareableHandle")
            region = cls._map(handle.value, size, ordinal)
        except CudaError:
            lib.cuMemRelease(handle.value)
            raise
        return region, fd.value

    @classmethod
    def open(cls, fd: int, size: int, device: torch.device, max_size: int) -> "DeviceRegion":
        """Map the region behind ``fd`` (another process's :meth:`create`) on ``device``; CudaError
        or ValueError if it is not one, lies elsewhere, or ``size`` is not a mappable size."""
        ordinal = torch.device(device).index if torch.device(device).index is not None else torch.cuda.current_device()
        _current(ordinal)
        g = granularity(ordinal)
        if type(size) is not int or not 0 < size <= max_size or size % g:
            raise ValueError(f"a device region is a multiple of {g} bytes, at most {max_size}; got {size!r}")
        lib, handle = _driver(), ctypes.c_ulonglong()
        _check(lib.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd), _POSIX_FD),
               "cuMemImportFromShareableHandle")
        try:
            prop = _Prop()
            _check(lib.cuMemGetAllocationPropertiesFromHandle(ctypes.byref(prop), handle.value),
                   "cuMemGetAllocationPropertiesFromHandle")
            if prop.location.type != _ON_DEVICE or prop.location.id != ordinal:
                raise ValueError("the device region lies on another device than this server's")
            return cls._map(handle.value, size, ordinal)  # a size beyond the allocation: cuMemMap refuses
        except (CudaError, ValueError):
            lib.cuMemRelease(handle.value)
            raise

    def close(self) -> None:
        """Unmap and let go (the memory lives on while the other process still maps it)."""
        if self.ptr:
            lib = _driver()
            self.tensor = None
            lib.cuMemUnmap(self.ptr, self.size)
            lib.cuMemAddressFree(self.ptr, self.size)
            lib.cuMemRelease(self.handle)
            self.ptr = 0
