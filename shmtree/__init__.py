"""shmtree: bandwidth-efficient allreduce between the processes of a worker pool on one machine.

The reduction runs on a tree laid over the machine (sockets, NUMA nodes, shared caches, cores),
pipelined chunk by chunk through lock-free rings in shared memory (Patarasuk & Yuan, IPDPS 2007).

    import numpy as np, shmtree

    def step(comm):
        return comm.allreduce(np.ones(4) * comm.rank)

    shmtree.run(step, 4)        # -> four arrays of [6., 6., 6., 6.]
"""
from ._version import __version__
from . import _moved  # noqa: F401  (the old import paths of the moved modules: issue 36)
from .errors import (CollectiveMismatchError, CollectiveTimeoutError, PeerLostError, RevokedError,
                     ShmtreeError, WorkerError)
from .machine.topology import Topology
from .api import (Communicator, Group, Persistent, Pool, Request, allgather, allreduce, barrier,
                  broadcast, current, empty, iallgather, iallreduce, ibarrier, ibroadcast,
                  ireduce, ireduce_scatter, rank, reduce, reduce_scatter, run, size, wait_all,
                  zeros,
                  alltoall, gather, scatter, scan, exscan, ialltoall, igather, iscatter, iscan,
                  iexscan, allreduce_init, broadcast_init, reduce_init, allgather_init,
                  reduce_scatter_init, alltoall_init, gather_init, scatter_init, scan_init,
                  exscan_init, barrier_init)
from .internode.multinode import from_mpi
from .p2p.records import ANY_SOURCE, ANY_TAG, Status
from .accumulator import Accumulator

__all__ = [
    "__version__",
    "Group", "Communicator", "Pool", "run",
    "allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "barrier", "rank", "size",
    "current",
    "iallreduce", "ibroadcast", "ireduce", "iallgather", "ireduce_scatter", "ibarrier",
    "alltoall", "gather", "scatter", "scan", "exscan",
    "ialltoall", "igather", "iscatter", "iscan", "iexscan",
    "allreduce_init", "broadcast_init", "reduce_init", "allgather_init", "reduce_scatter_init",
    "alltoall_init", "gather_init", "scatter_init", "scan_init", "exscan_init", "barrier_init",
    "Request", "Persistent", "wait_all", "empty", "zeros", "from_mpi", "Accumulator",
    "ANY_SOURCE", "ANY_TAG", "Status",
    "Topology",
    "ShmtreeError", "CollectiveMismatchError", "PeerLostError", "CollectiveTimeoutError",
    "WorkerError", "RevokedError",
]
