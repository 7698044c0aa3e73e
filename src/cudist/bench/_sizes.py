"""Byte sizes on the command line (``4K``, ``64M``, ``1G``: binary multiples, as nccl-tests)."""

from __future__ import annotations

import re

__all__ = ["parse_size", "format_size", "size_sweep", "physical_memory", "check_fits_in_memory"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text) -> int:
    """Parses a byte count: a plain integer, or a number with a K/M/G/T suffix (powers of 1024).

    ``KB``/``KiB`` spellings are accepted and mean the same as ``K``. Fractions are allowed when the
    result is a whole number of bytes (``1.5K`` = 1536).

    Raises:
        ValueError: the text is not a size, or is negative or fractional in bytes.
    """
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"invalid size {text!r}: expected a byte count such as 4096, 4K, 64M or 1G")
    num, unit = m.group(1), m.group(2).upper()
    mult = _UNITS[unit]
    if "." in num:
        whole, frac = num.split(".")
        value = int(whole) * mult + (int(frac) * mult) / (10 ** len(frac))
        if value != int(value):
            raise ValueError(f"invalid size {text!r}: not a whole number of bytes")
        return int(value)
    return int(num) * mult


def format_size(n: int) -> str:
    """Formats a byte count compactly: exact binary multiples get a suffix (``64M``), others bytes."""
    for unit in ("T", "G", "M", "K"):
        m = _UNITS[unit]
        if n >= m and n % m == 0:
            return f"{n // m}{unit}"
    return str(n)


def physical_memory() -> int | None:
    """This machine's physical memory in bytes (None where the OS does not say)."""
    import os

    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def check_fits_in_memory(nbytes: int, buffers: int = 1, what: str = "a buffer") -> None:
    """Raises ValueError if ``buffers`` buffers of ``nbytes`` bytes each cannot fit in physical memory.

    A benchmark point bigger than the machine would fail allocating (or, with memory overcommit,
    be killed while filling its buffers): say so before anything is allocated.
    """
    total = physical_memory()
    if total is not None and nbytes * buffers > total:
        need = f"{buffers} x {format_size(nbytes)}" if buffers > 1 else format_size(nbytes)
        have = f"{total / 2**30:.1f} GiB" if total >= 1 << 30 else format_size(total)
        raise ValueError(
            f"{what} needs at least {need} of memory, more than this machine's {have}; "
            "use smaller sizes (-b/--minbytes, -e/--maxbytes)"
        )


def size_sweep(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """Sizes ``min, min*f, min*f**2, ...`` up to and including ``max`` (nccl-tests' ``-b/-e/-f``).

    Raises:
        ValueError: min > max, or factor < 2 with min < max (the sweep would never end).
    """
    if min_bytes < 0 or max_bytes < 0:
        raise ValueError("sizes must be >= 0")
    if min_bytes > max_bytes:
        raise ValueError(f"min size {format_size(min_bytes)} (-b) is larger than max size {format_size(max_bytes)} (-e)")
    if min_bytes == max_bytes:
        return [min_bytes]
    if factor < 2:
        raise ValueError(f"the size factor (-f) must be >= 2 when -b < -e, got {factor}")
    if min_bytes == 0:
        raise ValueError("a sweep (-b < -e) cannot start at 0 bytes; use -b >= 1")
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= factor
    return out
