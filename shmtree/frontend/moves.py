"""The collectives that move data without reducing it - broadcast, allgather, barrier,
alltoall, gather, scatter - with their nonblocking forms: a mixin of Front (front.py), written
once over the communicator's hooks, as every public collective is.
"""
from __future__ import annotations

import numpy as np

from .. import arrays as _arrays
from . import calls
from ..arrays import either_foreign as _foreign, numpy_args as _numpy_args
from .calls import ALLGATHER, ALLTOALL, BARRIER, BROADCAST, GATHER, SCATTER
from .persistent import DECLINED


class _Moves:
    """Front's broadcast, allgather, barrier, alltoall, gather and scatter (and their i-forms)."""

    # ---- broadcast ----

    def broadcast(self, array, root=0, *, out=None, timeout=None):
        """Every rank gets the root's array; a new array, or `out` when given.

        Any dtype without Python objects is moved exactly (structured, datetime64, strings,
        either byte order).  Away from the root, `array` is None (the shape and dtype come from the
        root) or an array of the root's shape and dtype whose values are ignored.

        Parameters
        ----------
        array : array_like or None
            On the root: the data.  Elsewhere None, or an array of the root's shape and dtype
            (its values are ignored).
        %(root)s
        out : ndarray, optional
            Where the result is written, of the root's shape and dtype.  A rank that passes
            ``array=None`` with `out` claims `out`'s shape and dtype: if they differ from the
            root's, every rank raises `CollectiveMismatchError`.
        %(timeout)s

        Returns
        -------
        ndarray
            The root's array: `out` when given, else a new array, on every rank (the root too).

        Raises
        ------
        ValueError
            `root` is not a rank, the root passed None, `out` does not fit the array or is
            read-only.  %(local)s
        TypeError
            The dtype holds Python objects.  The rank that passed it raises this; it says so in the
            call's round, so the other ranks raise `CollectiveMismatchError` naming it.
        %(raises)s

        See Also
        --------
        ibroadcast, broadcast_init, scatter

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     x = np.arange(3) if comm.rank == 0 else None
        ...     return comm.broadcast(x, root=0).tolist()
        >>> shmtree.run(step, 2)
        [[0, 1, 2], [0, 1, 2]]
        """
        got = self._quick(BROADCAST, array, None, out, root, timeout)
        if got is not DECLINED:
            return got
        if _foreign(array, out):
            return _arrays.call(self.broadcast, array, out, "broadcast", root, timeout=timeout)
        return self._start(calls.broadcast(self, array, root, out, timeout))

    def ibroadcast(self, array, root=0, *, out=None, timeout=None):
        """broadcast, nonblocking: a Request

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     req = comm.ibroadcast(np.arange(2) if comm.rank == 0 else None)
        ...     return req.wait().tolist()
        >>> shmtree.run(step, 2)
        [[0, 1], [0, 1]]
        """
        array, out = _numpy_args(array, out, "ibroadcast")
        return self._start(calls.broadcast(self, array, root, out, timeout, posted=True))

    # ---- allgather ----

    def allgather(self, array, *, axis=None, out=None, timeout=None):
        """Every rank gets every rank's array: stacked (``axis=None``) or concatenated (``axis=0``).

        Any dtype without Python objects is moved exactly.  With ``axis=None`` the arrays have
        one shape, and ``result[r]`` is rank r's array; with ``axis=0`` they are concatenated along
        axis 0, in rank order (their other dimensions agree, their lengths may differ).

        Parameters
        ----------
        array : array_like
            This rank's part (``axis=0``: at least 1 dimension).
        axis : {None, 0}, default None
            None stacks equal shapes into ``(size, *array.shape)``; 0 concatenates along axis 0.
        out : ndarray, optional
            Where the result is written (``axis=None``: shape ``(size, *array.shape)``, the input's
            dtype).
        %(timeout)s

        Returns
        -------
        ndarray
            The gathered arrays, on every rank: `out` when given, else a new array.

        Raises
        ------
        TypeError
            The dtype holds Python objects, or a masked array.  %(local)s
        ValueError
            `axis` is neither None nor 0, a 0-d array with ``axis=0``, an `out` that does not fit.
            %(local)s
        %(raises)s

        See Also
        --------
        iallgather, allgather_init, gather, alltoall

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     g = comm.allgather(np.array([comm.rank, 10 * comm.rank]))
        ...     c = comm.allgather(np.arange(comm.rank + 1), axis=0)     # lengths 1 and 2
        ...     return g.tolist(), c.tolist()
        >>> shmtree.run(step, 2)
        [([[0, 0], [1, 10]], [0, 0, 1]), ([[0, 0], [1, 10]], [0, 0, 1])]
        """
        if axis is None:
            got = self._quick(ALLGATHER, array, None, out, 0, timeout)
            if got is not DECLINED:
                return got
        if _foreign(array, out):
            return _arrays.call(self.allgather, array, out, "allgather", axis=axis,
                                timeout=timeout)
        return self._start(calls.allgather(self, array, axis, out, timeout))

    def iallgather(self, array, *, axis=None, out=None, timeout=None):
        """allgather, nonblocking: a Request

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     return comm.iallgather(np.array([comm.rank])).wait().tolist()
        >>> shmtree.run(step, 2)
        [[[0], [1]], [[0], [1]]]
        """
        array, out = _numpy_args(array, out, "iallgather")
        return self._start(calls.allgather(self, array, axis, out, timeout, posted=True))

    # ---- barrier ----

    def barrier(self, timeout=None):
        """Return once every rank has entered the barrier.

        Parameters
        ----------
        %(timeout)s

        Returns
        -------
        None

        Raises
        ------
        ValueError
            A negative `timeout`.  %(local)s
        %(raises)s

        See Also
        --------
        ibarrier, barrier_init

        Examples
        --------
        >>> import shmtree
        >>> def step(comm):
        ...     comm.barrier(timeout=30)
        ...     return comm.rank
        >>> shmtree.run(step, 2)
        [0, 1]
        """
        got = self._quick(BARRIER, None, None, None, 0, timeout)
        if got is not DECLINED:
            return got
        return self._start(calls.barrier(self, timeout))

    def ibarrier(self, timeout=None):
        """barrier, nonblocking: a Request whose result is None.

        Examples
        --------
        >>> import shmtree
        >>> def step(comm):
        ...     req = comm.ibarrier()
        ...     return req.wait()
        >>> shmtree.run(step, 2)
        [None, None]
        """
        return self._start(calls.barrier(self, timeout, posted=True))

    # ---- alltoall ----

    def alltoall(self, array, *, counts=None, out=None, timeout=None):
        """Every rank sends a block of rows to every rank: equal blocks, or ``counts=`` rows each.

        With ``counts=None``, ``array.shape[0] == size``: row s goes to rank s, and
        ``result[s]`` is rank s's ``array[self.rank]``.  With `counts` (``size`` ints >= 0 summing
        to ``array.shape[0]``), ``counts[s]`` rows go to rank s, and the result concatenates along
        axis 0, in source-rank order, the rows each rank sent here.  The other dimensions and the
        dtype agree on every rank; any dtype without Python objects is moved exactly.

        Parameters
        ----------
        array : array_like
            This rank's rows, at least 1 dimension.
        counts : sequence of int, optional
            How many rows go to each rank (None: one block of equal size per rank).
        out : ndarray, optional
            Where the result is written.  With `counts`, its length is known only once every
            rank's counts are: an `out` of another length raises `ValueError` here and
            `CollectiveMismatchError` on the others.
        %(timeout)s

        Returns
        -------
        ndarray
            The rows received: the input's shape (``counts=None``), else ``(sum received,
            *array.shape[1:])``; `out` when given.

        Raises
        ------
        TypeError
            The dtype holds Python objects.  %(local)s
        ValueError
            ``array.shape[0] != size`` without `counts`, bad `counts`, an `out` that does not fit.
            %(local)s
        %(raises)s

        See Also
        --------
        ialltoall, alltoall_init, allgather, scatter

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     equal = comm.alltoall(np.array([10 * comm.rank, 10 * comm.rank + 1]))
        ...     if comm.rank == 0:
        ...         rows, counts = np.array([0, 1, 2]), [1, 2]     # 1 row to rank 0, 2 to rank 1
        ...     else:
        ...         rows, counts = np.array([100]), [1, 0]         # its only row to rank 0
        ...     return equal.tolist(), comm.alltoall(rows, counts=counts).tolist()
        >>> shmtree.run(step, 2)
        [([0, 10], [0, 100]), ([1, 11], [1, 2])]
        """
        got = self._quick(ALLTOALL, array, counts, out, 0, timeout)     # (op: the counts)
        if got is not DECLINED:
            return got
        if _foreign(array, out):
            return _arrays.call(self.alltoall, array, out, "alltoall", counts=counts,
                                timeout=timeout)
        return self._start(calls.alltoall(self, array, counts, out, timeout))

    def ialltoall(self, array, *, counts=None, out=None, timeout=None):
        """alltoall, nonblocking: a Request

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     return comm.ialltoall(np.array([comm.rank, comm.rank])).wait().tolist()
        >>> shmtree.run(step, 2)
        [[0, 1], [0, 1]]
        """
        array, out = _numpy_args(array, out, "ialltoall")
        return self._start(calls.alltoall(self, array, counts, out, timeout, posted=True))

    # ---- gather ----

    def gather(self, array, root=0, *, axis=None, out=None, timeout=None):
        """The root gets what allgather would give (a new array, or `out`); the others None.

        The rules of `allgather` (``axis=None`` stacks, ``axis=0`` concatenates); any dtype
        without Python objects is moved exactly.

        Parameters
        ----------
        array : array_like
            This rank's part.
        %(root)s
        axis : {None, 0}, default None
            As for `allgather`.
        out : ndarray, optional
            The root's output; ignored elsewhere.
        %(timeout)s

        Returns
        -------
        ndarray or None
            On the root, the gathered arrays (`out` when given); None elsewhere.

        Raises
        ------
        ValueError
            `root` is not a rank, `axis` neither None nor 0.  %(local)s  The root's `out` that does
            not fit, and an object dtype on any rank, are errors the others cannot see: that rank
            raises it and says so in the call's round, and the others raise
            `CollectiveMismatchError`.
        TypeError
            The dtype holds Python objects (said in the round, as above).
        %(raises)s

        See Also
        --------
        igather, gather_init, allgather, scatter

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     g = comm.gather(np.array([comm.rank, -comm.rank]), root=0)
        ...     return None if g is None else g.tolist()
        >>> shmtree.run(step, 2)
        [[[0, 0], [1, -1]], None]
        """
        if axis is None:
            got = self._quick(GATHER, array, None, out, root, timeout)
            if got is not DECLINED:
                return got
        if _foreign(array, out):
            return _arrays.call(self.gather, array, out, "gather", root, axis=axis,
                                timeout=timeout)
        return self._start(calls.gather(self, array, root, axis, out, timeout))

    def igather(self, array, root=0, *, axis=None, out=None, timeout=None):
        """gather, nonblocking: a Request (its result None on ranks other than the root).

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     g = comm.igather(np.array([comm.rank]), root=1).wait()
        ...     return None if g is None else g.tolist()
        >>> shmtree.run(step, 2)
        [None, [[0], [1]]]
        """
        array, out = _numpy_args(array, out, "igather")
        return self._start(calls.gather(self, array, root, axis, out, timeout, posted=True))

    # ---- scatter ----

    def scatter(self, array, root=0, *, axis=None, out=None, timeout=None):
        """The root's array split among the ranks: rank r gets ``array[r]``, or block r (axis=0).

        On the root, `array` has shape ``(size, *rest)`` with ``axis=None`` (rank r gets
        ``array[r]``), or any length with ``axis=0`` (rank r gets
        ``np.array_split(array, size, axis=0)[r]``).  Elsewhere `array` is None.  Any dtype without
        Python objects is moved exactly.

        Parameters
        ----------
        array : array_like or None
            On the root, the blocks; None elsewhere.
        %(root)s
        axis : {None, 0}, default None
            None: one row per rank; 0: ``np.array_split`` along axis 0.
        out : ndarray, optional
            Where this rank's block is written (an array of the block's shape and dtype, filled
            in place), on any rank.
        %(timeout)s

        Returns
        -------
        ndarray
            This rank's block: `out` when given, else a new array.

        Raises
        ------
        ValueError
            `root` is not a rank, `axis` neither None nor 0, `out` not a writable ndarray.
            %(local)s  The root's errors (no array, a shape or `out` that does not fit) are errors
            the others cannot see: the root raises it and says so in the call's round, and the
            others raise `CollectiveMismatchError`.
        TypeError
            The root's dtype holds Python objects (said in the round, as above).
        %(raises)s

        See Also
        --------
        iscatter, scatter_init, broadcast, gather, alltoall

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     table = np.array([[1, 2], [3, 4]]) if comm.rank == 0 else None
        ...     return comm.scatter(table, root=0).tolist()
        >>> shmtree.run(step, 2)
        [[1, 2], [3, 4]]
        """
        if axis is None:
            got = self._quick(SCATTER, array, None, out, root, timeout)
            if got is not DECLINED:
                return got
        if _foreign(array, out):
            return _arrays.call(self.scatter, array, out, "scatter", root, axis=axis,
                                timeout=timeout)
        return self._start(calls.scatter(self, array, root, axis, out, timeout))

    def iscatter(self, array, root=0, *, axis=None, out=None, timeout=None):
        """scatter, nonblocking: a Request

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     table = np.array([[5], [6]]) if comm.rank == 0 else None
        ...     return comm.iscatter(table).wait().tolist()
        >>> shmtree.run(step, 2)
        [[5], [6]]
        """
        array, out = _numpy_args(array, out, "iscatter")
        return self._start(calls.scatter(self, array, root, axis, out, timeout, posted=True))
