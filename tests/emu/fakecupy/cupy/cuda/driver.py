"""Fake ``cupy.cuda.driver``: the driver error type the fake raises for missing kernel symbols, and
the occupancy calculator."""

from __future__ import annotations

CUDA_ERROR_NOT_FOUND = 500


class CUDADriverError(RuntimeError):
    def __init__(self, status: int, msg: str = ""):
        self.status = int(status)
        super().__init__(msg or f"CUDA driver error {status}")


def get_build_version() -> int:
    return 12080


#: Blocks of 256 threads per SM the emulator reports for every kernel (an H100 fits 5 of cudist's
#: 48-register kernels; fewer keeps the emulated grids small, so grid-stride loops take turns).
OCCUPANCY_BLOCKS_PER_SM = 4


def occupancyMaxActiveBlocksPerMultiprocessor(func: int, blockSize: int, dynamicSMemSize: int) -> int:  # noqa: N802
    if not isinstance(func, int) or func == 0:
        raise CUDADriverError(400, "CUDA_ERROR_INVALID_HANDLE: not a kernel function handle")
    if not 1 <= int(blockSize) <= 1024:
        raise CUDADriverError(1, "CUDA_ERROR_INVALID_VALUE: block size out of range")
    return max(1, OCCUPANCY_BLOCKS_PER_SM * 256 // int(blockSize))
