"""A job that survives preemption (issue #29): 40 SGD-momentum steps through PreemptionCheckpointHandler.run.

``python -m cudist.launch -n W --max-restarts 1 preemption_job.py MODE DIRECTORY``: with W > 1 workers a
MultiWorkerMirroredStrategy (one CPU replica each), with one a MirroredStrategy over two CPU replicas.
The checkpoint (weights, optimizer slots, the distributed iterator's position, the handler's run count)
is saved every 5 runs through a CheckpointManager. MODE:

* ``none``: the uninterrupted reference;
* ``sigterm``: in the first attempt (CUDIST_RESTART_COUNT=0), the last worker sends itself SIGTERM
  after run 17: the workers agree on it during run 18 and every worker saves at the call after it
  and exits with code 42; the restart resumes at 18;
* ``sigkill``: the same with SIGKILL: the job dies, the restart resumes from the save at run 15;
* ``async``: ``sigkill``, with the periodic saves asynchronous (CheckpointOptions(enable_async=True));
* ``slow``: uninterrupted, 0.1 s a step (for a test to signal the launcher meanwhile).

Each worker prints ``RESULT <rank> <json>``: where it started, which attempt, and its final weights'
bytes (hex), for the test to compare bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

import cudist
from cudist import data, train
from cudist.train.experimental import PreemptionCheckpointHandler

STEPS, AT, EVERY, BATCH = 40, 17, 5, 8


def main(mode: str, directory: str) -> None:
    workers = int(os.environ.get("PMI_SIZE", "1"))
    if workers > 1:
        strategy = cudist.MultiWorkerMirroredStrategy()
        resolver = strategy.cluster_resolver
        rank = int(resolver.task_id)
    else:
        cpu = cudist.config.list_physical_devices("CPU")[0]
        cudist.config.set_logical_device_configuration(cpu, [cudist.config.LogicalDeviceConfiguration()] * 2)
        strategy = cudist.MirroredStrategy(["/cpu:0", "/cpu:1"])
        resolver, rank = None, 0
    restart = int(os.environ.get("CUDIST_RESTART_COUNT", "0"))
    rng = np.random.default_rng(7)
    x = rng.standard_normal((STEPS * BATCH, 16)).astype(np.float32)
    y = rng.standard_normal((STEPS * BATCH, 4)).astype(np.float32)
    dist = strategy.experimental_distribute_dataset(data.Dataset.from_tensor_slices((x, y)).batch(BATCH))
    with strategy.scope():
        w = cudist.Variable(np.full((16, 4), 0.01, np.float32), name="w")
        opt = cudist.optimizers.SGD(0.05, momentum=0.9)
    iterator = iter(dist)
    ckpt = train.Checkpoint(w=w, optimizer=opt, iterator=iterator)
    manager = train.CheckpointManager(ckpt, directory, max_to_keep=2)
    handler = PreemptionCheckpointHandler(resolver, manager)  # restores the latest checkpoint
    start = handler.total_run_calls
    options = train.CheckpointOptions(enable_async=True) if mode == "async" else None

    def train_step(it):
        def fn(batch):
            xb, yb = batch
            wv = np.asarray(w.read_value())
            grad = (2.0 / BATCH) * (xb.T @ (xb @ wv - yb))
            opt.apply_gradients([(grad.astype(np.float32), w)])

        strategy.run(fn, args=(next(it),))
        if mode == "slow":
            time.sleep(0.1)

    for _ in range(start, STEPS):
        handler.run(train_step, iterator)
        runs = handler.total_run_calls
        if runs % EVERY == 0:
            manager.save(options=options)
        if restart == 0 and runs == AT and rank == workers - 1 and mode in ("sigterm", "sigkill", "async"):
            if mode == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)  # handled: the job saves and exits at the next run
            else:
                if mode == "sigkill":  # "async": killed while the save of run 15 may still be written
                    manager.sync()
                os.kill(os.getpid(), signal.SIGKILL)
    manager.sync()
    result = {"start": start, "restart": restart, "runs": handler.total_run_calls, "w": w.numpy().tobytes().hex(),
              "iterations": int(opt.iterations.numpy())}
    print(f"RESULT {rank} {json.dumps(result)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
