"""Cross-device utilities under :mod:`cudist._cross_device_ops` (TF's ``cross_device_utils``).

* :mod:`.packing`: reductions of per-replica leaves (packing leaves of one dtype into one kernel
  call), gathers, the structure checks;
* :mod:`.placement`: destinations, results placed on them, the GPU layout of a device list;
* :mod:`.nccl`: CuPy's NCCL bindings, communicators, the grouped all-reduce.

They sit between the kernel contract (:mod:`cudist._kernels`) below and the cross-device ops,
strategies and variables above; nothing here imports those.
"""
