"""Transports: how reduced bytes cross processes and GPUs.

* :mod:`.mpi`: the workers' communicator (mpi4py), its checks, deadlines and stall warnings;
* :mod:`.nccl`: CuPy's NCCL bindings, the single-process and cross-worker communicators;
* :mod:`.shm`: the intra-node all-reduce of host buffers over MPI-3 shared memory (node leaders over MPI).
"""
