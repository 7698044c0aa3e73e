"""``python -m cudist.bench``: the same as the ``cudist-bench`` console script."""

from cudist.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
