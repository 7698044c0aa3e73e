"""Fake ``cupy.cuda.driver``: the driver error type the fake raises for missing kernel symbols."""

from __future__ import annotations

CUDA_ERROR_NOT_FOUND = 500


class CUDADriverError(RuntimeError):
    def __init__(self, status: int, msg: str = ""):
        self.status = int(status)
        super().__init__(msg or f"CUDA driver error {status}")


def get_build_version() -> int:
    return 12080
