"""Joining a group: the one place communicators are made (docs/design.md, "Layers").

Group.join (group.py) admits this process as a rank - the segment's header checked, the rank
marked joined, the process pinned, the rings it produces placed - and hands it to join() here,
which makes the rank's Communicator, and around it the communicator across nodes when the group
is one node of several (multinode.spanning_member), and makes it this process's (session).
group.py imports nothing above it: this module registers join() into it when it is imported
(shmtree's __init__ imports it, through api).
"""
from __future__ import annotations

import weakref

from ..groups import group as _group, session
from ..communicators.communicator import Communicator
from ..internode.multinode import spanning_member

__all__ = ["join"]


def join(group, rank):
    """The communicator of `rank`, which Group.join admitted in this process.

    Not called directly: ``group.join(rank)`` admits the rank (checks the segment's header,
    pins the process, places its rings) and hands it here.  The communicator becomes this
    process's (``shmtree.current()``); when the group is one node of several (``inter=``), the
    communicator across nodes is made around it and returned instead.

    Parameters
    ----------
    group : Group
        The group, already admitting `rank` in this process.
    rank : int
        The local rank.

    Returns
    -------
    Communicator
        This rank's communicator (across nodes: the spanning one).

    Examples
    --------
    >>> import multiprocessing, shmtree
    >>> def worker(group, rank, results):
    ...     with group.join(rank) as comm:            # Group.join comes here
    ...         results.put((rank, comm is shmtree.current()))
    >>> ctx = multiprocessing.get_context("fork")
    >>> results = ctx.Queue()
    >>> with shmtree.Group(2) as group:
    ...     procs = [ctx.Process(target=worker, args=(group, r, results)) for r in range(2)]
    ...     for p in procs:
    ...         p.start()
    ...     got = sorted(results.get(timeout=60) for _ in procs)
    ...     for p in procs:
    ...         p.join()
    >>> got
    [(0, True), (1, True)]
    """
    session._warn_if_member_elsewhere(group, rank, stacklevel=3)    # (the caller of Group.join)
    comm = Communicator(group, rank)
    group._comm = weakref.ref(comm)      # (Group.close closes this process's member)
    session._set_current(comm)
    if group._span is not None:          # a node of several: the communicator spans them
        comm = spanning_member(group, comm)
        session._set_current(comm)
    return comm


_group._made_by(join)
