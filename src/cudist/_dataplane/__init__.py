"""The data plane: the runtime under the TF-shaped modules, one owner per verb.

* storage and update: a variable's copies and the fused update pass (``storage``, ``update``);
* :mod:`.reduce`: the reductions -- the one ``all_reduce`` entry (the host fast path, then the
  general path), batch reduce, reduce-to-one, gather;
* :mod:`.pool`: the pooled result buffers of the host reductions;
* :mod:`.packing`: leaves of one dtype packed into one buffer per kernel call, the structure checks;
* :mod:`.placement`: destinations, results placed on them, the GPU layout of a device list;
* :mod:`.transports`: how bytes cross processes (:mod:`.transports.mpi`) and GPUs
  (:mod:`.transports.nccl`).

The orchestration (``_distribute_lib``, ``_cross_device_ops``, the strategies, variables, optimizers)
calls in; nothing in the reductions, the pool or the transports imports those.
"""
