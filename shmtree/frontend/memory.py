"""Shared arrays (empty, zeros) and sub-communicators (split, dup, split_by): a mixin of Front
(front.py); the sub-communicators' makers are registered here by shmtree.communicators.subcomm.
"""
from __future__ import annotations

import numpy as np


class _Memory:
    """Front's shared arrays and sub-communicators."""

    # ---- shared arrays ----

    def empty(self, shape, dtype=float, order="C"):
        """A collective: an array that every member can read and write, one on every rank.

        Every rank asks for the same shape, dtype and order, and gets a numpy array of its own
        whose memory the other members map.  A collective whose input and `out` are such arrays
        runs single-copy: each rank reads every rank's input and writes every rank's output in
        place, without going through the rings (the same bits as on private arrays).  Allocate
        once and reuse: allocating is a collective with a memory file per rank.  The memory lives
        while this rank holds a reference (views included), and is unshared when the communicator
        closes (arrays still held stay valid as private memory).

        Parameters
        ----------
        shape : int or tuple of int
            The array's shape, the same on every rank.
        dtype : data-type, default float
            Any dtype without Python objects.
        order : {"C", "F"}, default "C"
            Memory layout.

        Returns
        -------
        ndarray
            This rank's array (uninitialised).

        Raises
        ------
        ValueError
            A bad shape (a negative dimension).  %(local)s
        TypeError
            A dtype that holds Python objects.  %(local)s
        CollectiveMismatchError
            The ranks asked for different shapes, dtypes or orders (``empty`` on one rank and
            ``zeros`` on another is the same request); raised on every rank.
        MemoryError
            The arrays do not fit what the machine, the memory cgroup or this rank's limits
            (``ulimit -f``, ``ulimit -v``) can give; raised on every rank, nothing allocated, and
            the group stays usable.
        PeerLostError
            A member died or left, or the group was aborted.

        See Also
        --------
        zeros, allreduce

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     g = comm.empty(3)
        ...     g[:] = comm.rank + 1
        ...     comm.allreduce(g, out=g)          # single copy, in place
        ...     return g.tolist()
        >>> shmtree.run(step, 2)
        [[3.0, 3.0, 3.0], [3.0, 3.0, 3.0]]
        """
        return self._shared_array(shape, dtype, order, "empty")

    def zeros(self, shape, dtype=float, order="C"):
        """empty, filled with zeros (fresh shared memory is zero).

        Parameters
        ----------
        shape : int or tuple of int
            The array's shape, the same on every rank.
        dtype : data-type, default float
            Any dtype without Python objects.
        order : {"C", "F"}, default "C"
            Memory layout.

        Returns
        -------
        ndarray
            This rank's array, all zeros.

        Raises
        ------
        ValueError, TypeError, CollectiveMismatchError, MemoryError, PeerLostError
            As for `empty`.

        See Also
        --------
        empty

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     grads = comm.zeros(2, np.float32)
        ...     grads += comm.rank
        ...     return comm.allreduce(grads, out=grads).tolist()
        >>> shmtree.run(step, 3)
        [[3.0, 3.0], [3.0, 3.0], [3.0, 3.0]]
        """
        return self._shared_array(shape, dtype, order, "zeros")

    # ---- sub-communicators (issue 24: shmtree/subcomm.py, registered into _SPLIT) ----

    def split(self, color, key=None):
        """A collective: the ranks passing the same `color` form a new communicator.

        The new communicator is ranked by ``(key, rank here)`` and is a full one (every
        collective and its forms, shared arrays, messages, split again), with a group and a plan
        of its own over its members' cores.  Closing it is local; closing this communicator does
        not close it.  Every rank of this communicator makes the call, in the same order as its
        other collectives.

        Parameters
        ----------
        color : int or None
            An int >= 0: the ranks of one color form one communicator.  None: this rank takes no
            part (and gets None).
        key : int, optional
            Orders the new ranks (ties broken by the rank here); defaults to the rank here.

        Returns
        -------
        Communicator or None
            This rank's new communicator (a context manager), or None for ``color=None``.

        Raises
        ------
        ValueError
            A `color` or `key` that is not an int (>= 0 for the color).  %(local)s
        CollectiveMismatchError
            Another rank made another collective meanwhile; raised on every rank, and this
            communicator stays usable.
        PeerLostError
            A member died or left, or the group was aborted.

        See Also
        --------
        dup, split_by

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     with comm.split(comm.rank % 2) as sub:          # the even ranks, the odd ranks
        ...         total = sub.allreduce(np.array(comm.rank))
        ...         return sub.rank, sub.size, int(total)
        >>> shmtree.run(step, 4)
        [(0, 2, 2), (0, 2, 4), (1, 2, 2), (1, 2, 4)]
        """
        return _split_maker()[0](self, color, key)

    def dup(self):
        """A new communicator of the same ranks in the same order: split(0).

        Returns
        -------
        Communicator
            This rank's new communicator.

        Raises
        ------
        CollectiveMismatchError, PeerLostError
            As for `split`.

        See Also
        --------
        split

        Examples
        --------
        >>> import shmtree
        >>> def step(comm):
        ...     with comm.dup() as twin:
        ...         return twin.rank == comm.rank, twin.size
        >>> shmtree.run(step, 2)
        [(True, 2), (True, 2)]
        """
        return self.split(0)

    def split_by(self, level):
        """A collective: split by the part of the machine the ranks share, like MPI_Comm_split_type.

        Ranks keep their order.

        Parameters
        ----------
        level : {"socket", "numa", "l3", "node"}
            ``"socket"``, ``"numa"``, ``"l3"`` (the cores that share a last-level cache) or
            ``"node"`` (the ranks of one machine: every rank of a one-machine communicator).

        Returns
        -------
        Communicator
            The communicator of the ranks that share this rank's part of the machine.

        Raises
        ------
        ValueError
            An unknown `level`.  %(local)s
        CollectiveMismatchError, PeerLostError
            As for `split`.

        See Also
        --------
        split

        Examples
        --------
        >>> import shmtree
        >>> def step(comm):
        ...     with comm.split_by("node") as node:
        ...         return node.size
        >>> shmtree.run(step, 2)
        [2, 2]
        """
        return _split_maker()[1](self, level)


# sub-communicators: (split, split_by) of shmtree.communicators.subcomm, which registers them when imported
# (shmtree's __init__ imports it, through api): this module imports nothing above it
_SPLIT = None


def _made_by(split, split_by):
    """Register the makers of Front.split and Front.split_by."""
    global _SPLIT
    _SPLIT = (split, split_by)


def _split_maker():
    if _SPLIT is None:
        from ..errors import ShmtreeError
        raise ShmtreeError("shmtree: split needs shmtree.communicators.subcomm (import shmtree)")
    return _SPLIT
