"""Fake ``cupy.cuda.runtime``: the CUDA runtime calls cudist makes, over the emulated machine."""

from __future__ import annotations

from cupy import _emu

cudaSuccess = 0
cudaErrorInvalidValue = 1
cudaErrorMemoryAllocation = 2
cudaErrorInsufficientDriver = 35
cudaErrorInvalidDevice = 101
cudaErrorNoDevice = 100
cudaErrorPeerAccessUnsupported = 217
cudaErrorInvalidResourceHandle = 400
cudaErrorNotReady = 600
cudaErrorPeerAccessAlreadyEnabled = 704
cudaErrorPeerAccessNotEnabled = 705
cudaErrorIllegalAddress = 700

_NAMES = {
    0: ("cudaSuccess", "no error"),
    1: ("cudaErrorInvalidValue", "invalid argument"),
    2: ("cudaErrorMemoryAllocation", "out of memory"),
    35: ("cudaErrorInsufficientDriver", "CUDA driver version is insufficient for CUDA runtime version"),
    100: ("cudaErrorNoDevice", "no CUDA-capable device is detected"),
    101: ("cudaErrorInvalidDevice", "invalid device ordinal"),
    217: ("cudaErrorPeerAccessUnsupported", "peer access is not supported between these two devices"),
    400: ("cudaErrorInvalidResourceHandle", "invalid resource handle"),
    600: ("cudaErrorNotReady", "device not ready"),
    700: ("cudaErrorIllegalAddress", "an illegal memory access was encountered"),
    704: ("cudaErrorPeerAccessAlreadyEnabled", "peer access is already enabled"),
    705: ("cudaErrorPeerAccessNotEnabled", "peer access has not been enabled"),
}

_TOTAL_MEM = 80 * 1024**3


class CUDARuntimeError(RuntimeError):
    """As ``cupy_backends.cuda.api.runtime.CUDARuntimeError``: ``status`` is the cudaError_t code."""

    def __init__(self, status: int):
        self.status = int(status)
        name, desc = _NAMES.get(self.status, (f"cudaError{self.status}", "unknown error"))
        super().__init__(f"{name}: {desc}")

    def __reduce__(self):
        return (type(self), (self.status,))


def getDeviceCount() -> int:
    # As CUDA: a driver older than the runtime's major version fails every call that needs it.
    if _emu.DRIVER_VERSION // 1000 < _emu.RUNTIME_VERSION // 1000:
        raise CUDARuntimeError(cudaErrorInsufficientDriver)
    return _emu.DEVICE_COUNT


def getDevice() -> int:
    return _emu.THREAD.device


def setDevice(device: int) -> None:
    _emu.check_device_id(device)
    _emu.THREAD.device = int(device)


def deviceCanAccessPeer(device: int, peerDevice: int) -> int:
    _emu.check_device_id(device)
    _emu.check_device_id(peerDevice)
    return int(_emu.can_access_peer(int(device), int(peerDevice)))


def deviceEnablePeerAccess(peerDevice: int, flags: int = 0) -> None:
    """Lets kernels of the current device access ``peerDevice``'s memory (one direction only)."""
    _emu.check_device_id(peerDevice)
    if flags != 0:
        raise CUDARuntimeError(cudaErrorInvalidValue)
    dev = _emu.THREAD.device
    if peerDevice == dev:
        raise CUDARuntimeError(cudaErrorInvalidDevice)
    if not _emu.can_access_peer(dev, int(peerDevice)):
        raise CUDARuntimeError(cudaErrorPeerAccessUnsupported)
    key = (dev, int(peerDevice))
    if key in _emu.PEER_ENABLED:
        raise CUDARuntimeError(cudaErrorPeerAccessAlreadyEnabled)
    _emu.PEER_ENABLED.add(key)


def deviceDisablePeerAccess(peerDevice: int) -> None:
    key = (_emu.THREAD.device, int(peerDevice))
    if key not in _emu.PEER_ENABLED:
        raise CUDARuntimeError(cudaErrorPeerAccessNotEnabled)
    _emu.PEER_ENABLED.discard(key)


def getDeviceProperties(device: int) -> dict:
    _emu.check_device_id(device)
    return {
        "name": b"NVIDIA H100 80GB HBM3 (cudist emulator)",  # bytes, as CuPy returns it
        "totalGlobalMem": _TOTAL_MEM,
        "multiProcessorCount": _emu.SMS,
        "major": 9,
        "minor": 0,
        "warpSize": 32,
        "maxThreadsPerBlock": 1024,
        "pciBusID": 0x10 + int(device),
        "pciDeviceID": 0,
        "pciDomainID": 0,
    }


def memGetInfo() -> tuple[int, int]:
    used = sum(a.capacity for a in list(_emu._ALLOCS.values()) if a.device == _emu.THREAD.device)
    return _TOTAL_MEM - used, _TOTAL_MEM


def deviceSynchronize() -> None:
    _emu.synchronize_device(_emu.THREAD.device)


def driverGetVersion() -> int:
    return _emu.DRIVER_VERSION


def runtimeGetVersion() -> int:
    return _emu.RUNTIME_VERSION


is_hip = False
