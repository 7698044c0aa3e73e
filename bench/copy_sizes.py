"""Copy bandwidth by buffer size, for every copy method ``cudist-bench`` knows.

``%copy`` in ``cudist-bench`` divides by a copy of ``--copy-size`` bytes (64 MiB by default), timed
back to back; this script shows how each method's rate changes with the size (cache effects, and
where a method switches to streaming stores), so a ceiling can be judged against the size of the
point it divides. Every copy method of the header (``cudist.bench._sysinfo.measure_copy_bandwidth``),
median of back-to-back copies per size, bytes read + written per second.

Usage: ``python bench/copy_sizes.py [--sizes 4M,16M,64M,128M,256M,512M] [--iters 8]``.
"""

from __future__ import annotations

import argparse
import gc

from cudist.bench._sizes import format_size, parse_size
from cudist.bench._sysinfo import measure_copy_bandwidth


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="4M,16M,64M,128M,256M,512M", help="bytes per buffer, comma list")
    p.add_argument("--iters", type=int, default=8, help="timed copies per size and method (default 8)")
    a = p.parse_args(argv)
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    print("# copy bandwidth by buffer size (GB/s = 2 * size / median time); working set = 2 * size")
    header = None
    for size in sizes:
        rates = measure_copy_bandwidth(size, iters=a.iters).results
        if header is None:
            header = list(rates)
            print("#  buffer " + "".join(f"{m[:30]:>32}" for m in header))
        print(f"{format_size(size):>9} " + "".join(f"{rates.get(m, float('nan')):>32.3g}" for m in header))
        gc.collect()  # the last size's buffers, before the next size's
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
