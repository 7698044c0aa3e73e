"""Fake ``cupy.random``: NumPy's generators, results copied onto the current device."""

from __future__ import annotations

import numpy as _np

from cupy._core import _to_device

_state = _np.random.RandomState()


def seed(seed=None):
    _state.seed(seed)


def _dev(x, dtype=None):
    x = _np.asarray(x)
    return _to_device(x if dtype is None else x.astype(dtype))


def rand(*size, dtype=float):
    return _dev(_state.random_sample(size), dtype)


def randn(*size, dtype=float):
    return _dev(_state.standard_normal(size), dtype)


def random(size=None, dtype=float):
    return _dev(_state.random_sample(size), dtype)


random_sample = random


def standard_normal(size=None, dtype=float):
    return _dev(_state.standard_normal(size), dtype)


def normal(loc=0.0, scale=1.0, size=None, dtype=float):
    return _dev(_state.normal(loc, scale, size), dtype)


def uniform(low=0.0, high=1.0, size=None, dtype=float):
    return _dev(_state.uniform(low, high, size), dtype)


def randint(low, high=None, size=None, dtype=int):
    return _dev(_state.randint(low, high, size), dtype)


class Generator:
    def __init__(self, seed=None):
        self._g = _np.random.default_rng(seed)

    def standard_normal(self, size=None, dtype=_np.float64):
        return _dev(self._g.standard_normal(size), dtype)

    def random(self, size=None, dtype=_np.float64):
        return _dev(self._g.random(size), dtype)

    def integers(self, low, high=None, size=None, dtype=_np.int64, endpoint=False):
        return _dev(self._g.integers(low, high, size, dtype=dtype, endpoint=endpoint))

    def uniform(self, low=0.0, high=1.0, size=None):
        return _dev(self._g.uniform(low, high, size))

    def normal(self, loc=0.0, scale=1.0, size=None):
        return _dev(self._g.normal(loc, scale, size))


def default_rng(seed=None):
    return Generator(seed)
