"""A progress bar for sweeps: tqdm when installed, else a plain stderr line.

tqdm is not a dependency. Nothing is drawn unless stderr is a terminal, and nothing
before ``delay`` seconds have passed, so short runs and logs stay clean.
"""

from __future__ import annotations

import sys
import time

__all__ = ["Progress"]


class Progress:
    """Counts finished steps of a sweep of known length; use as a context manager."""

    def __init__(self, total: int, desc: str, *, enabled: bool | None = None, delay: float = 0.5):
        self.total, self.desc, self.delay = total, desc, delay
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.n = 0
        self._t0 = time.monotonic()
        self._impl = None
        self._kind = "line"
        self._drawn = False
        if not self.enabled:
            self._kind = "off"
            return
        try:
            from tqdm import tqdm  # optional

            self._impl = tqdm(total=total, desc=desc, delay=delay, leave=False, file=sys.stderr)
            self._kind = "tqdm"
        except ImportError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def update(self, label: str = "") -> None:
        """Marks one step done; ``label`` names the step just finished."""
        self.n += 1
        if self._kind == "off":
            return
        if self._kind == "tqdm":
            if label:
                self._impl.set_postfix_str(label, refresh=False)
            self._impl.update(1)
            return
        if time.monotonic() - self._t0 < self.delay:
            return
        width = 24
        done = int(width * self.n / max(self.total, 1))
        sys.stderr.write(f"\r{self.desc} [{'#' * done}{'.' * (width - done)}] {self.n}/{self.total} {label[:40]:<40}")
        sys.stderr.flush()
        self._drawn = True

    def clear(self) -> None:
        """Erases the bar so a line can be printed; the next update draws it again."""
        if self._kind == "tqdm":
            self._impl.clear()
        elif self._drawn:
            sys.stderr.write("\r" + " " * 100 + "\r")
            sys.stderr.flush()
            self._drawn = False

    def close(self) -> None:
        """Removes the bar."""
        if self._kind == "tqdm":
            self._impl.close()
        elif self._drawn:
            sys.stderr.write("\r" + " " * 100 + "\r")
            sys.stderr.flush()
        self._kind = "off"
