"""TF1-era input iterators: ``make_dataset_iterator`` and ``make_input_fn_iterator`` (deprecated in TF).

Iterators with ``initialize()`` and ``get_next()``, over the same step machinery as
:mod:`cudist._input_lib`'s distributed datasets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from cudist import data as _data
from cudist._input_lib import (
    DistributedIterator,
    InputContext,
    InputReplicationMode,
    Placer,
    StrategyLike,
    new_iterator,
    split_steps,
    turn_steps,
)

__all__ = ["DatasetIterator", "InputFunctionIterator"]


class _V1Iterator:
    def __init__(self, strategy: StrategyLike) -> None:
        self._strategy = strategy
        self._n = len(strategy.extended.worker_devices)  # this worker's replicas
        self._iterator: DistributedIterator | None = None
        self.initialize()

    def _make_steps(self, putters: Placer) -> Iterator[Any]:
        raise NotImplementedError

    def initialize(self) -> list[Any]:
        """(Re)starts the iteration from the beginning. Returns the (empty) list of init ops."""
        if self._iterator is not None:
            self._iterator.close()
        self._iterator = new_iterator(self._strategy, True, self._make_steps, self._n, None)
        return []

    def get_next(self) -> Any:
        """The next step.

        Returns:
            A PerReplica at each leaf of the element (the plain value for one replica); typed
            ``Any``, as the element's structure is the dataset's.

        Raises:
            OutOfRangeError: the input is exhausted.
        """
        return self._iterator.get_next()  # type: ignore[union-attr]  # set by initialize()

    def __iter__(self) -> DistributedIterator:
        return self._iterator  # type: ignore[return-value]  # set by initialize()


class DatasetIterator(_V1Iterator):
    """``make_dataset_iterator(dataset)``: global batches split across the replicas, TF1 style.

    Args:
        dataset: a :class:`cudist.data.Dataset` of global batches, or any iterable of them.
        strategy: the :class:`cudist.Strategy` whose replicas get the pieces.
    """

    def __init__(self, dataset: Iterable[Any], strategy: StrategyLike) -> None:
        self._dataset = _data.as_dataset(dataset, "make_dataset_iterator")
        super().__init__(strategy)

    def _make_steps(self, putters: Placer) -> Iterator[Any]:
        return split_steps(self._dataset, self._n, putters, "make_dataset_iterator")


class InputFunctionIterator(_V1Iterator):
    """``make_input_fn_iterator(input_fn)``: the function's per-replica batches dealt in turn, TF1 style.

    As in TF1, a step for which some replica has no batch left ends the iteration.

    Args:
        input_fn: returns a :class:`cudist.data.Dataset` (or an iterable) of per-replica batches
            for the :class:`cudist.InputContext` it gets.
        strategy: the :class:`cudist.Strategy` whose replicas get the batches.
        replication_mode: only ``InputReplicationMode.PER_WORKER`` is supported.

    Raises:
        ValueError: another replication mode.
        TypeError: ``input_fn`` is not callable.
    """

    def __init__(
        self,
        input_fn: Callable[[InputContext], Iterable[Any]],
        strategy: StrategyLike,
        replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER,
    ) -> None:
        if replication_mode != InputReplicationMode.PER_WORKER:
            raise ValueError(f"Input replication mode not supported: {replication_mode!r}")
        if not callable(input_fn):
            raise TypeError(f"make_input_fn_iterator: input_fn must be callable, got {type(input_fn).__name__}")
        n = len(strategy.extended.worker_devices)  # this worker's replicas
        self._dataset = _data.as_dataset(input_fn(InputContext(1, 0, n)), "make_input_fn_iterator")
        super().__init__(strategy)

    def _make_steps(self, putters: Placer) -> Iterator[Any]:
        return turn_steps(self._dataset, self._n, putters, partial=False)
