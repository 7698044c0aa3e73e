"""The data plane: the runtime under cudist's TF-shaped modules, one owner per verb.

The TF-named modules (``_distribute_lib``, the strategies, ``_cross_device_ops``, ``_variables``,
``optimizers``) orchestrate: contexts, checks, flatten/unflatten, Keras/TF semantics. The buffers
and the fast paths live here:

* :mod:`cudist._dataplane.storage`: a variable's storage -- its N copies, the primary array,
  copy-on-write snapshots, host storage shared by mirrored copies and split on a lone write, the
  per-device groups, the kernel backend of its arrays; reached as ``variable.storage``;
* :mod:`cudist._dataplane.update`: the fused update pass of the optimizers -- planning, gradient
  settling, dispatch to the kernels (plain and fused all-reduce + update) driven by one table of
  update rules (``cudist._kernels.UPDATE_KERNELS``), the weight-decay pass;
* :mod:`cudist._dataplane.reduce`: the reductions -- the one ``all_reduce`` entry (the host fast
  path, then the general path), batch reduce, reduce-to-one, gather;
* :mod:`cudist._dataplane.pool`: the pooled result buffers of the host reductions;
* :mod:`cudist._dataplane.packing`: leaves of one dtype packed into one buffer per kernel call, the
  structure checks;
* :mod:`cudist._dataplane.placement`: destinations, results placed on them, the GPU layout of a
  device list;
* :mod:`cudist._dataplane.transports`: how bytes cross processes (``transports.mpi``; within a
  node ``transports.shm``) and GPUs (``transports.nccl``).

Nothing here imports the TF-shaped modules; the kernels (:mod:`cudist._kernels`) sit below.
"""
