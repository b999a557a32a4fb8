"""The public API in one place: Group, Communicator, run, Pool and the module-level calls.

Each lives in a module of its own (docs/design.md, "Layers"; the API reference of the docs,
docs/api/, is made from their docstrings); imports point one way, down:

    pool          Pool (and its multiprocessing.pool overrides)
    launch        run                                   (pool uses its start checks)
    joining       join: the one place communicators are made (Group.join hands it the rank)
    multinode     from_mpi; NodeGroup, what Group(size, inter=mpi_comm) makes
    nodes         Spanning, the communicator across nodes
    communicator  Communicator; allreduce, broadcast, reduce, allgather, reduce_scatter,
                  alltoall, gather, scatter, scan, exscan, barrier, their i- and _init forms,
                  empty, zeros (made from front's), rank, size
    requests      Request, wait_all, the progress thread
    collectives   Communicator's executors (allreduce ... scan, exscan)
    front, calls  the public collectives written once; one parser per collective (CallSpec);
                  persistent: Persistent, a call bound once
    group         Group
    session       current(): this process's communicator; the fork generation
    plan, transport, liveness
    schedule, topology
    codes, errors (leaves: any module may import them)

Nothing calls upward: group.py imports nothing above it.  joining and multinode register into
it when they are imported (here, and by shmtree's __init__): Group.join admits the rank and
hands it to joining.join; Group(..., inter=) makes a multinode.NodeGroup.

This module only re-exports them.  `_rebuild_group` stays importable here: Group pickles made by
older versions name it as shmtree.api._rebuild_group.
"""
from .communicators.communicator import (Communicator, Persistent, Request, allgather, allreduce, barrier,
                           broadcast, current, empty, iallgather, iallreduce, ibarrier,
                           ibroadcast, ireduce, ireduce_scatter, rank, reduce, reduce_scatter,
                           size, wait_all, zeros,
                           alltoall, gather, scatter, scan, exscan, ialltoall, igather,
                           iscatter, iscan, iexscan, allreduce_init, broadcast_init,
                           reduce_init, allgather_init, reduce_scatter_init, alltoall_init,
                           gather_init, scatter_init, scan_init, exscan_init, barrier_init)
from .groups.group import Group, _rebuild_group  # noqa: F401  (_rebuild_group: see above)
from .launching import joining  # noqa: F401  (registers Group.join's maker)
from .communicators import subcomm  # noqa: F401  (registers Front.split's makers)
from .launching import shrink  # noqa: F401  (registers comm.shrink's maker)
from .launching.launch import run
from .launching.pool import Pool

__all__ = ["Group", "Communicator", "Pool", "run", "allreduce", "broadcast", "reduce",
           "allgather", "reduce_scatter", "barrier", "iallreduce", "ibroadcast", "ireduce",
           "iallgather", "ireduce_scatter", "ibarrier", "Request", "wait_all", "empty", "zeros",
           "rank", "size", "current", "Persistent",
           "alltoall", "gather", "scatter", "scan", "exscan", "ialltoall", "igather", "iscatter",
           "iscan", "iexscan", "allreduce_init", "broadcast_init", "reduce_init",
           "allgather_init", "reduce_scatter_init", "alltoall_init", "gather_init",
           "scatter_init", "scan_init", "exscan_init", "barrier_init"]
