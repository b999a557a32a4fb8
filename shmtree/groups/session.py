"""This process's membership (docs/design.md, "Layers"): which communicator the module-level
calls use, and the fork generation.  A leaf: it imports only errors and the standard library,
so every module may read it (through the module, never copied by `from ... import`: the names
change):

    _current     this process's communicator (the one it joined last, or set by from_mpi)
    _joined      weak references to the communicators it joined, oldest first
    _pool_group  (group, fork generation) in a Pool worker, even one without a rank
    _fork_gen    incremented in every forked child: a child sees another generation, and does
                 not inherit communicators (a communicator made here keeps the generation it
                 was made in, `comm._gen`)

A communicator is anything with `group`, `rank`, `size`, `_closed`, `_gen` (Communicator, and
nodes.Spanning around one).
"""
from __future__ import annotations

import os
import warnings
import weakref

from ..errors import PeerLostError, ShmtreeError

__all__ = ["current"]

_current = None
_joined: list = []
_pool_group = None
_fork_gen = 0


def _after_fork_in_child():
    global _fork_gen
    _fork_gen += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


def _warn_if_member_elsewhere(group, rank, stacklevel=2):
    """Joining `group` as `rank`: warn when this process is already a live member of another
    group (the module-level calls move to the new one).  stacklevel: of the caller's caller,
    as warnings.warn counts it from the caller."""
    other = _current if (_current is not None and not _current._closed
                         and _current._gen == _fork_gen) else None
    if other is not None and other.group is not group:
        warnings.warn(f"shmtree: this process is rank {other.rank} of another group and now "
                      f"joins a second one as rank {rank}; shmtree.current() and the "
                      f"module-level calls use the new group from here on (and this one "
                      f"again once the new one is closed)", RuntimeWarning,
                      stacklevel=stacklevel + 1)


def _set_current(comm):
    """Make `comm` this process's communicator (None: the one that was is closing).  Every
    communicator set here is remembered: once the current one is closed, current() falls back
    to the latest one still open (a second group closed, the first one still joined)."""
    global _current
    _current = comm
    if comm is not None:
        _joined[:] = [ref for ref in _joined if ref() is not None and ref() is not comm
                      and ref()._gen == _fork_gen] + [weakref.ref(comm)]


def _usable(comm) -> bool:
    return (comm is not None and not comm._closed and comm._gen == _fork_gen
            and not comm.group._closed)


def _set_pool_group(group):
    """In a Pool worker: the pool's group, for current() to explain a worker without a rank."""
    global _pool_group
    _pool_group = (group, _fork_gen)


def current():
    """This process's communicator (set by Group.join, Pool, run and from_mpi): the one it
    joined last, or once that one is closed, the latest one still open."""
    comm = _current
    if _usable(comm):
        return comm
    mine = [c for c in (ref() for ref in _joined) if c is not None and c._gen == _fork_gen]
    for c in reversed(mine):
        if _usable(c):
            _set_current(c)             # the group still joined (a later one was closed)
            return c
    if _pool_group is not None and _pool_group[1] == _fork_gen:
        group = _pool_group[0]
        raise PeerLostError("shmtree.Pool: this worker has no rank in the pool's group ("
                            + (group.describe_abort() if not group.closed else
                               "the pool is closed") + ")")
    if mine:
        last = mine[-1]
        how = "its group was closed" if last.group.closed else "it was closed"
        raise ShmtreeError(f"shmtree: this process is no longer in any group: it was rank "
                           f"{last.rank} of {last.size} in {last.group!r}, and {how} (join a "
                           f"group again with shmtree.run, shmtree.Pool or Group.join)")
    raise ShmtreeError("shmtree: this process has not joined a group (use shmtree.run, "
                       "shmtree.Pool or Group.join)")
