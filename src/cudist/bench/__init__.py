"""``cudist-bench``: nccl-tests-style microbenchmarks of cudist's kernels and strategies.

Run ``cudist-bench`` (or ``python -m cudist.bench``) for the default suite, or a subcommand
(``all-reduce``, ``all-gather``, ``broadcast``, ``split``, ``update``, ``run-overhead``, ``step``,
``user-path``: ``strategy.run`` + ``all_reduce`` and ``apply_gradients`` next to the kernels) with
``--help`` for its flags. Importing this package costs nothing beyond argparse: NumPy, numba,
the native extension and CuPy are loaded only by the subcommands that use them.
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv=None) -> int:
    """Runs the benchmark CLI; returns the process exit status (0 on success).

    Args:
        argv: arguments without the program name; None reads ``sys.argv[1:]``.
    """
    from cudist.bench._cli import main as _main

    return _main(argv)
