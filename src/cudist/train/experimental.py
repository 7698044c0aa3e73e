"""``cudist.train.experimental``: surviving preemption (TF's ``tf.distribute.experimental.PreemptionCheckpointHandler``
and ``TerminationConfig``).

::

    handler = cudist.train.experimental.PreemptionCheckpointHandler(
        strategy.cluster_resolver, checkpoint, checkpoint_dir="/tmp/run")
    for _ in range(handler.total_run_calls, STEPS):
        handler.run(train_step, iterator)

with ``python -m cudist.launch -n 2 --max-restarts 3 train.py``. How the workers agree on the step
and save: :mod:`cudist.train._preemption`.
"""

from __future__ import annotations

from cudist.train._preemption import RESTART_EXIT_CODE, PreemptionCheckpointHandler, TerminationConfig

__all__ = ["PreemptionCheckpointHandler", "RESTART_EXIT_CODE", "TerminationConfig"]
