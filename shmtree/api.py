"""The public API in one place: Group, Communicator, run, Pool and the module-level calls.

Each lives in a module of its own (README.md, "How it works"); imports point one way, down:

    pool          Pool (and its multiprocessing.pool overrides)
    launch        run                                   (pool uses its start checks)
    communicator  Communicator; current, allreduce, broadcast, reduce, allgather,
                  reduce_scatter, barrier, their i-forms, rank, size
    requests      Request, wait_all, the progress thread
    collectives   broadcast, reduce, allgather, reduce_scatter (Communicator's methods)
    group         Group
    plan, transport, liveness
    schedule, topology
    codes, errors (leaves: any module may import them)

The one call upward: Group.join imports communicator when it runs, to hand out a Communicator.

This module only re-exports them.  `_rebuild_group` stays importable here: Group pickles made by
older versions name it as shmtree.api._rebuild_group.
"""
from .communicator import (Communicator, Request, allgather, allreduce, barrier, broadcast,
                           current, empty, iallgather, iallreduce, ibarrier, ibroadcast,
                           ireduce, ireduce_scatter, rank, reduce, reduce_scatter, size,
                           wait_all, zeros)
from .group import Group, _rebuild_group  # noqa: F401  (_rebuild_group: see above)
from .launch import run
from .pool import Pool

__all__ = ["Group", "Communicator", "Pool", "run", "allreduce", "broadcast", "reduce",
           "allgather", "reduce_scatter", "barrier", "iallreduce", "ibroadcast", "ireduce",
           "iallgather", "ireduce_scatter", "ibarrier", "Request", "wait_all", "empty", "zeros",
           "rank", "size", "current"]
