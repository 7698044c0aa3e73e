"""The benchmark CLI's user-facing error."""

from __future__ import annotations

__all__ = ["BenchError"]


class BenchError(Exception):
    """A problem with the request the user can fix (printed as ``cudist-bench: error: ...``, exit 2)."""
