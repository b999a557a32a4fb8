"""The public API in one place: Group, Communicator, run, Pool and the module-level calls.

Each lives in a module of its own (README.md, "How it works"); the imports point one way:

    pool (Pool)  ->  launch (run)  ->  communicator (Communicator, current, allreduce,
    barrier, rank, size)  ->  group (Group)  ->  plan, transport, liveness  ->  schedule,
    topology, codes, errors

(pool takes launch's start-method and pickling checks; launch needs only group.  The one call
upward: Group.join imports communicator when it runs, to hand out the Communicator.)

This module only re-exports them.  `_rebuild_group` stays importable here: Group pickles made by
older versions name it as shmtree.api._rebuild_group.
"""
from .communicator import Communicator, allreduce, barrier, current, rank, size
from .group import Group, _rebuild_group  # noqa: F401  (_rebuild_group: see above)
from .launch import run
from .pool import Pool

__all__ = ["Group", "Communicator", "Pool", "run", "allreduce", "barrier", "rank", "size",
           "current"]
