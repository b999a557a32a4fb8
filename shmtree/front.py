"""The public collectives, written once (docs/design.md, "One call"): Front, and the
module-level functions made from it.

Every communicator - one machine's (Communicator) and the one across nodes (Spanning) - is a
Front: its public methods parse their arguments into a CallSpec (calls.py) and hand it to the
communicator's two hooks,

    _run(spec)     run the call now, in this thread (a blocking call), and return its result;
    _post(spec)    hand it to the rank's progress thread: a Request (a nonblocking call);

and, optionally,

    _quick(coll, array, op, out, root, timeout)
                   the engine's C twin of the parse (Engine.call), for a plain ndarray call of a
                   blocking collective: the result, or DECLINED when the call must be parsed
                   first (it then runs exactly as _run(spec) would have run it);
    _local_error(spec)
                   a rooted call's local error only this rank can see (spec.error): say it to
                   the other ranks, and return the exception to raise;
    _shared_array(shape, dtype, order, how)
                   empty / zeros: shared arrays;
    _bind(spec, slow)
                   a persistent call's engine call with its arguments bound (Communicator:
                   a function of no arguments that runs it, or slow() - the bound spec through
                   _start - when it cannot run that way now), or None: the Persistent then
                   runs the bound spec through _start every time.

Persistent calls (the *_init forms) parse once, bind their output (out=, or one made at init;
where its shape is the peers' to say, the first call's result), and run the bound call each
time: Persistent (persistent.py).

Arrays of other libraries (torch, cupy on the host, anything with __array_interface__ or the
buffer protocol) are viewed as numpy's here, once, and the result given back as the caller
expects it (arrays.py).
"""
from __future__ import annotations

import functools
import inspect

import numpy as np

from . import arrays as _arrays, calls
from .arrays import either_foreign as _foreign, numpy_args as _numpy_args
from .calls import (ALLGATHER, ALLREDUCE, ALLTOALL, BARRIER, BROADCAST, EXSCAN, GATHER, REDUCE,
                    REDUCE_SCATTER, SCAN, SCATTER)
from .persistent import DECLINED, Persistent

__all__ = ["Front", "DECLINED", "PUBLIC", "module_functions", "Persistent"]


class Front:
    """The collectives of a communicator (rank, size, and the hooks above).

    Every public collective is written here once, with its nonblocking (``i``) and persistent
    (``_init``) forms; :class:`shmtree.Communicator` (one machine) and the communicator across
    nodes (``from_mpi``, ``inter=``) are Fronts, and the module-level functions
    (``shmtree.allreduce`` ...) call the same methods on the process's communicator.  The
    docstrings' shared parts (the op, the timeout, the errors every call can raise) and the
    sections of an ``i`` or ``_init`` form that are its blocking call's are filled in once, at
    import (``_document`` below).
    """

    # ---- allreduce ----

    def allreduce(self, array, op="sum", *, out=None, timeout=None):
        """Reduce `array` over all ranks with `op`; a new array, or `out` when given.

        A collective: every rank makes the call, with the same shape, dtype and op, and gets the
        same result.  Integer and bitwise results, ``min`` and ``max`` are exact; float and complex
        ``sum`` and ``prod`` are folded in the order of the group's tree or schedule, which may
        differ from numpy's in the last bits (the same bits on every rank, and run to run).  Arrays
        from `empty` / `zeros` (input and `out`) run single-copy.

        Parameters
        ----------
        %(array)s
            Its dtype: bool, int8-64, uint8-64, float16/32/64, complex64/128 or bfloat16
            (``ml_dtypes.bfloat16``, ``torch.bfloat16``).
        %(op)s
        out : ndarray or writable buffer, optional
            Where the result is written: an array of the input's shape and dtype (or a writable
            buffer of as many items).  May be `array` itself (in place) or overlap it.
        %(timeout)s

        Returns
        -------
        ndarray
            The reduction, of the input's shape and dtype: `out` when given, else a new array
            (a torch tensor when the input is one).

        Raises
        ------
        TypeError
            The dtype or the op/dtype pair has no reduction (objects, structured, a bitwise op of
            floats), or `array` is a masked array.  %(local)s
        ValueError
            An unknown `op`, an `out` of another shape or dtype or read-only, a negative `timeout`.
            %(local)s
        %(raises)s

        See Also
        --------
        iallreduce, allreduce_init, reduce, reduce_scatter, scan

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     x = np.arange(3.0) * (comm.rank + 1)
        ...     total = comm.allreduce(x)                # a new array
        ...     comm.allreduce(x, op="max", out=x)       # in place
        ...     return total.tolist(), x.tolist()
        >>> shmtree.run(step, 2)
        [([0.0, 3.0, 6.0], [0.0, 2.0, 4.0]), ([0.0, 3.0, 6.0], [0.0, 2.0, 4.0])]
        """
        got = self._quick(ALLREDUCE, array, op, out, 0, timeout)
        if got is not DECLINED:
            return got
        if _foreign(array, out):
            return _arrays.call(self.allreduce, array, out, "allreduce", op, timeout=timeout)
        return self._start(calls.allreduce(self, array, op, out, timeout))

    def iallreduce(self, array, op="sum", *, out=None, timeout=None):
        """allreduce, nonblocking: a Request

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     req = comm.iallreduce(np.ones(2))     # computes meanwhile ...
        ...     return req.wait().tolist()
        >>> shmtree.run(step, 2)
        [[2.0, 2.0], [2.0, 2.0]]
        """
        array, out = _numpy_args(array, out, "iallreduce")
        return self._start(calls.allreduce(self, array, op, out, timeout, posted=True))

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

    # ---- reduce ----

    def reduce(self, array, op="sum", root=0, *, out=None, timeout=None):
        """The root gets what allreduce would give (a new array, or `out`); the others get None.

        The dtypes, ops and numeric rule of `allreduce`.

        Parameters
        ----------
        %(array)s
        %(op)s
        %(root)s
        out : ndarray or writable buffer, optional
            The root's output, as for `allreduce`; ignored on the other ranks.
        %(timeout)s

        Returns
        -------
        ndarray or None
            On the root, the reduction (`out` when given); None elsewhere.

        Raises
        ------
        TypeError
            As for `allreduce`.  A dtype that cannot be reduced is an error the other ranks cannot
            see: this rank raises it and says so in the call's round, so the others raise
            `CollectiveMismatchError` naming it.
        ValueError
            An unknown `op`, `root` not a rank, an `out` that does not fit.  %(local)s
        %(raises)s

        See Also
        --------
        ireduce, reduce_init, allreduce, gather

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     s = comm.reduce(np.full(2, comm.rank + 1), root=1)
        ...     return None if s is None else s.tolist()
        >>> shmtree.run(step, 2)
        [None, [3, 3]]
        """
        got = self._quick(REDUCE, array, op, out, root, timeout)
        if got is not DECLINED:
            return got
        if _foreign(array, out):
            return _arrays.call(self.reduce, array, out, "reduce", op, root, timeout=timeout)
        return self._start(calls.reduce(self, array, op, root, out, timeout))

    def ireduce(self, array, op="sum", root=0, *, out=None, timeout=None):
        """reduce, nonblocking: a Request (its result None on ranks other than the root).

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     s = comm.ireduce(np.ones(2), root=0).wait()
        ...     return None if s is None else s.tolist()
        >>> shmtree.run(step, 2)
        [[2.0, 2.0], None]
        """
        array, out = _numpy_args(array, out, "ireduce")
        return self._start(calls.reduce(self, array, op, root, out, timeout, posted=True))

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

    # ---- reduce_scatter ----

    def reduce_scatter(self, array, op="sum", *, out=None, timeout=None):
        """Rank r gets np.array_split(the full reduction, size, axis=0)[r].

        The full reduction is `allreduce`'s (its dtypes, ops and numeric rule); the blocks
        follow ``np.array_split``, so the length along axis 0 need not divide by the size.

        Parameters
        ----------
        %(array)s  At least 1 dimension.
        %(op)s
        out : ndarray, optional
            Where this rank's block is written: a writable array of the block's shape and the
            input's dtype.
        %(timeout)s

        Returns
        -------
        ndarray
            This rank's block of the reduction: `out` when given, else a new array.

        Raises
        ------
        TypeError
            As for `allreduce`.  %(local)s
        ValueError
            A 0-d array, an unknown `op`, an `out` that does not fit.  %(local)s
        %(raises)s

        See Also
        --------
        ireduce_scatter, reduce_scatter_init, allreduce, scatter

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     return comm.reduce_scatter(np.arange(5.0)).tolist()     # 2 * arange(5), split in 2
        >>> shmtree.run(step, 2)
        [[0.0, 2.0, 4.0], [6.0, 8.0]]
        """
        got = self._quick(REDUCE_SCATTER, array, op, out, 0, timeout)
        if got is not DECLINED:
            return got
        if _foreign(array, out):
            return _arrays.call(self.reduce_scatter, array, out, "reduce_scatter", op,
                                timeout=timeout)
        return self._start(calls.reduce_scatter(self, array, op, out, timeout))

    def ireduce_scatter(self, array, op="sum", *, out=None, timeout=None):
        """reduce_scatter, nonblocking: a Request

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     return comm.ireduce_scatter(np.arange(4)).wait().tolist()
        >>> shmtree.run(step, 2)
        [[0, 2], [4, 6]]
        """
        array, out = _numpy_args(array, out, "ireduce_scatter")
        return self._start(calls.reduce_scatter(self, array, op, out, timeout, posted=True))

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

    # ---- scan, exscan ----

    def scan(self, array, op="sum", *, out=None, timeout=None):
        """Rank r gets the reduction of ranks 0..r's arrays, in rank order.

        Bit for bit ``ufunc.accumulate(np.stack(inputs), axis=0, dtype=input_dtype)[r]``: the
        op is applied in rank order (float16 and bfloat16 rounded after every step, as numpy does;
        complex products use `allreduce`'s kernel).  The dtypes and ops of `allreduce`.

        Parameters
        ----------
        %(array)s
        %(op)s
        out : ndarray or writable buffer, optional
            Where the result is written, as for `allreduce`.
        %(timeout)s

        Returns
        -------
        ndarray
            The inclusive prefix reduction: `out` when given, else a new array.

        Raises
        ------
        TypeError
            As for `allreduce`.  %(local)s
        ValueError
            As for `allreduce`.  %(local)s
        %(raises)s

        See Also
        --------
        iscan, scan_init, exscan, allreduce

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     return comm.scan(np.array([comm.rank + 1])).tolist()
        >>> shmtree.run(step, 3)
        [[1], [3], [6]]
        """
        got = self._quick(SCAN, array, op, out, 0, timeout)
        if got is not DECLINED:
            return got
        if _foreign(array, out):
            return _arrays.call(self.scan, array, out, "scan", op, timeout=timeout)
        return self._start(calls.scan(self, array, op, out, timeout))

    def iscan(self, array, op="sum", *, out=None, timeout=None):
        """scan, nonblocking: a Request

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     return comm.iscan(np.array([comm.rank + 1])).wait().tolist()
        >>> shmtree.run(step, 2)
        [[1], [3]]
        """
        array, out = _numpy_args(array, out, "iscan")
        return self._start(calls.scan(self, array, op, out, timeout, posted=True))

    def exscan(self, array, op="sum", *, out=None, timeout=None):
        """Rank r gets the reduction of ranks 0..r-1's arrays; rank 0 the op's identity.

        The exclusive form of `scan`.  Rank 0 gets the op's identity: sum 0, prod 1, min the
        dtype's largest value (or +inf), max its smallest (or -inf), band all ones (True), bor and
        bxor 0.

        Parameters
        ----------
        %(array)s
        %(op)s
        out : ndarray or writable buffer, optional
            Where the result is written, as for `allreduce`.
        %(timeout)s

        Returns
        -------
        ndarray
            The exclusive prefix reduction: `out` when given, else a new array.

        Raises
        ------
        TypeError
            As for `allreduce`.  %(local)s
        ValueError
            As for `allreduce`.  %(local)s
        %(raises)s

        See Also
        --------
        iexscan, exscan_init, scan

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     return comm.exscan(np.array([comm.rank + 1])).tolist()
        >>> shmtree.run(step, 3)
        [[0], [1], [3]]
        """
        got = self._quick(EXSCAN, array, op, out, 0, timeout)
        if got is not DECLINED:
            return got
        if _foreign(array, out):
            return _arrays.call(self.exscan, array, out, "exscan", op, timeout=timeout)
        return self._start(calls.exscan(self, array, op, out, timeout))

    def iexscan(self, array, op="sum", *, out=None, timeout=None):
        """exscan, nonblocking: a Request

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     return comm.iexscan(np.array([comm.rank + 1])).wait().tolist()
        >>> shmtree.run(step, 2)
        [[0], [1]]
        """
        array, out = _numpy_args(array, out, "iexscan")
        return self._start(calls.exscan(self, array, op, out, timeout, posted=True))

    # ---- persistent calls: checked and bound once (persistent.py) ----

    def allreduce_init(self, array, op="sum", *, out=None, timeout=None):
        """allreduce, bound once: a Persistent (p() runs it, p.start() posts it).

        A plain ndarray call of p() is one engine call with its arguments bound: no parse, no
        allocation.

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     x = np.ones(2)
        ...     p = comm.allreduce_init(x, out=x)      # checked and bound once
        ...     for _ in range(3):
        ...         p()                                # 2, 4, then 8 in place
        ...     return x.tolist()
        >>> shmtree.run(step, 2)
        [[8.0, 8.0], [8.0, 8.0]]
        """
        return self._init("allreduce", array, out, lambda a, o: calls.allreduce(
            self, a, op, o, timeout))

    def broadcast_init(self, array, root=0, *, out=None, timeout=None):
        """broadcast, bound once: a Persistent.

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     x = np.zeros(2)
        ...     p = comm.broadcast_init(x, root=0, out=x)
        ...     if comm.rank == 0:
        ...         x[:] = 7
        ...     p()
        ...     return x.tolist()
        >>> shmtree.run(step, 2)
        [[7.0, 7.0], [7.0, 7.0]]
        """
        return self._init("broadcast", array, out, lambda a, o: calls.broadcast(
            self, a, root, o, timeout))

    def reduce_init(self, array, op="sum", root=0, *, out=None, timeout=None):
        """reduce, bound once: a Persistent (None away from the root).

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     p = comm.reduce_init(np.ones(2), root=0)
        ...     s = p()
        ...     return None if s is None else s.tolist()
        >>> shmtree.run(step, 2)
        [[2.0, 2.0], None]
        """
        return self._init("reduce", array, out, lambda a, o: calls.reduce(
            self, a, op, root, o, timeout))

    def allgather_init(self, array, *, axis=None, out=None, timeout=None):
        """allgather, bound once: a Persistent.

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     x = np.array([comm.rank])
        ...     p = comm.allgather_init(x)
        ...     return p().tolist()
        >>> shmtree.run(step, 2)
        [[[0], [1]], [[0], [1]]]
        """
        return self._init("allgather", array, out, lambda a, o: calls.allgather(
            self, a, axis, o, timeout))

    def reduce_scatter_init(self, array, op="sum", *, out=None, timeout=None):
        """reduce_scatter, bound once: a Persistent.

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     p = comm.reduce_scatter_init(np.arange(4))
        ...     return p().tolist()
        >>> shmtree.run(step, 2)
        [[0, 2], [4, 6]]
        """
        return self._init("reduce_scatter", array, out, lambda a, o: calls.reduce_scatter(
            self, a, op, o, timeout))

    def alltoall_init(self, array, *, counts=None, out=None, timeout=None):
        """alltoall, bound once: a Persistent.

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     p = comm.alltoall_init(np.array([comm.rank, comm.rank]))
        ...     return p().tolist()
        >>> shmtree.run(step, 2)
        [[0, 1], [0, 1]]
        """
        return self._init("alltoall", array, out, lambda a, o: calls.alltoall(
            self, a, counts, o, timeout))

    def gather_init(self, array, root=0, *, axis=None, out=None, timeout=None):
        """gather, bound once: a Persistent (None away from the root).

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     g = comm.gather_init(np.array([comm.rank]), root=0)()
        ...     return None if g is None else g.tolist()
        >>> shmtree.run(step, 2)
        [[[0], [1]], None]
        """
        return self._init("gather", array, out, lambda a, o: calls.gather(
            self, a, root, axis, o, timeout))

    def scatter_init(self, array, root=0, *, axis=None, out=None, timeout=None):
        """scatter, bound once: a Persistent.

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     table = np.array([[5], [6]]) if comm.rank == 0 else None
        ...     return comm.scatter_init(table, root=0)().tolist()
        >>> shmtree.run(step, 2)
        [[5], [6]]
        """
        return self._init("scatter", array, out, lambda a, o: calls.scatter(
            self, a, root, axis, o, timeout))

    def scan_init(self, array, op="sum", *, out=None, timeout=None):
        """scan, bound once: a Persistent.

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     p = comm.scan_init(np.array([comm.rank + 1]))
        ...     return p().tolist(), p() is p()             # the same output array each time
        >>> shmtree.run(step, 2)
        [([1], True), ([3], True)]
        """
        return self._init("scan", array, out, lambda a, o: calls.scan(self, a, op, o, timeout))

    def exscan_init(self, array, op="sum", *, out=None, timeout=None):
        """exscan, bound once: a Persistent.

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     return comm.exscan_init(np.array([comm.rank + 1]))().tolist()
        >>> shmtree.run(step, 2)
        [[0], [1]]
        """
        return self._init("exscan", array, out, lambda a, o: calls.exscan(
            self, a, op, o, timeout))

    def barrier_init(self, timeout=None):
        """barrier, bound once: a Persistent (p() returns None).

        Examples
        --------
        >>> import shmtree
        >>> def step(comm):
        ...     p = comm.barrier_init()
        ...     return p(), p.start().wait()
        >>> shmtree.run(step, 2)
        [(None, None), (None, None)]
        """
        return self._init("barrier", None, None, lambda a, o: calls.barrier(self, timeout))

    def _init(self, name, array, out, parse):
        """A Persistent of the call parse(array, out) makes (arrays of other libraries viewed
        as numpy's once; the result returned as the plain call would: out= as given, a torch
        tensor for torch input)."""
        a, o = _numpy_args(array, out, name + "_init")
        spec = parse(a, o)
        if spec.error is None:
            spec = spec._replace(out=_output(self, spec))
        given = out if out is not None and o is not out else None
        torch = out is None and _arrays._is_torch(array)
        return Persistent(self, spec, given, torch)

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

    # ---- the hooks' defaults, and the one dispatch ----

    def _start(self, spec):
        """A parsed call: its local error raised (said to the others first), else run now or
        posted."""
        if spec.error is not None:
            raise self._local_error(spec) from None
        return self._post(spec) if spec.posted else self._run(spec)

    def _quick(self, coll, array, op, out, root, timeout):
        return DECLINED

    def _local_error(self, spec):
        return spec.error

    def _bind(self, spec, slow):
        return None


def _output(comm, spec):
    """A persistent call's output, made at init: out= as given, else a new array when this
    rank gets a result whose shape it knows locally (None: none, or the peers' to say - the
    first call's result is then bound)."""
    a, out, coll = spec.array, spec.out, spec.coll
    if out is not None:
        return out
    if coll in (ALLREDUCE, SCAN, EXSCAN) or (coll == ALLTOALL and spec.counts is None):
        return np.empty(a.shape, a.dtype)
    if coll == REDUCE:
        return np.empty(a.shape, a.dtype) if comm.rank == spec.root else None
    if coll == REDUCE_SCATTER:
        return np.empty(calls.scatter_shape(a, None, comm.size, comm.rank)[2], a.dtype)
    if coll == ALLGATHER and spec.axis is None:
        return np.empty((comm.size,) + a.shape, a.dtype)
    if coll == BROADCAST and a is not None:
        return np.empty(a.shape, a.dtype)
    if coll == GATHER and spec.axis is None and comm.rank == spec.root:
        return np.empty((comm.size,) + a.shape, a.dtype)
    if coll == SCATTER and a is not None:
        if spec.axis is None:
            return np.empty(a.shape[1:], a.dtype)
        b = calls.split_bounds(a.shape[0], comm.size)
        return np.empty((b[comm.rank + 1] - b[comm.rank],) + a.shape[1:], a.dtype)
    return None


# sub-communicators: (split, split_by) of shmtree.subcomm, which registers them when imported
# (shmtree's __init__ imports it, through api): this module imports nothing above it
_SPLIT = None


def _made_by(split, split_by):
    """Register the makers of Front.split and Front.split_by."""
    global _SPLIT
    _SPLIT = (split, split_by)


def _split_maker():
    if _SPLIT is None:
        from .errors import ShmtreeError
        raise ShmtreeError("shmtree: split needs shmtree.subcomm (import shmtree)")
    return _SPLIT


PUBLIC = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "barrier",
          "alltoall", "gather", "scatter", "scan", "exscan",
          "iallreduce", "ibroadcast", "ireduce", "iallgather", "ireduce_scatter", "ibarrier",
          "ialltoall", "igather", "iscatter", "iscan", "iexscan",
          "allreduce_init", "broadcast_init", "reduce_init", "allgather_init",
          "reduce_scatter_init", "alltoall_init", "gather_init", "scatter_init", "scan_init",
          "exscan_init", "barrier_init",
          "empty", "zeros")


def module_functions(current):
    """The module-level calls: each PUBLIC method of Front, made on current() (the process's
    communicator), with the method's signature less self and its docstring."""
    made = {}
    for name in PUBLIC:
        method = getattr(Front, name)

        def forward(*args, _name=name, **kwargs):
            return getattr(current(), _name)(*args, **kwargs)
        functools.update_wrapper(forward, method)
        del forward.__wrapped__
        sig = inspect.signature(method)
        forward.__signature__ = sig.replace(parameters=list(sig.parameters.values())[1:])
        forward.__qualname__ = name
        made[name] = forward
    return made


# ---- the docstrings' shared parts, filled in once at import (as matplotlib's %(name)s) ----

_PARTS = {
    "array": """\
array : array_like
    This rank's input: an ndarray of any shape (0-d too) and any layout, a buffer
    (``array.array``), or a CPU array of another library (a torch tensor, anything with
    ``__dlpack__`` or the array interface).  Not modified, unless it is `out`.""",
    "op": """\
op : {"sum", "prod", "min", "max", "band", "bor", "bxor"} or ufunc, default "sum"
    The reduction.  ``np.add``, ``np.multiply``, ``np.minimum``, ``np.maximum``,
    ``np.bitwise_and``, ``np.bitwise_or`` and ``np.bitwise_xor`` name the same ops; the
    bitwise ones take integer and bool dtypes.""",
    "root": """\
root : int, default 0
    The root rank, in ``0 .. size-1``; every rank passes the same.""",
    "timeout": """\
timeout : float, optional
    Seconds this rank waits for the call (None: no limit).  Checked between the engine's
    20 ms time slices, also while data moves; running past it raises
    `CollectiveTimeoutError` and aborts the group.""",
    "raises": """\
CollectiveMismatchError
    The ranks disagree on the call (the collective, or what the call compares: shapes,
    dtypes, ops, roots); raised on every rank, naming what each passed.  The group stays
    usable.
CollectiveTimeoutError
    `timeout` ran out on this rank; the group is aborted.
PeerLostError
    A member died or left the group before making the call, or the group was aborted.
ShmtreeError
    This communicator is closed, or was inherited by a forked child.""",
    "local": "Raised locally, before any communication; the group stays usable.",
}

_NONBLOCKING = """\
The same arguments and checks as `{name}`; the call is posted to this communicator's
progress thread, which runs the posted calls in the order they were posted (blocking and
nonblocking calls mix freely, in issue order).  Until the request is done, do not modify
the input and do not read `out`.  The call's `timeout` counts from posting.

{parameters}Returns
-------
Request
    A `concurrent.futures.Future`; ``wait()`` (or ``result()``) gives what `{name}`
    returns.

Raises
------
TypeError, ValueError
    The local errors of `{name}`, raised by this call.  The group stays usable.
ShmtreeError
    This communicator is closed, or was inherited by a forked child.

Notes
-----
A failure of the call itself fails the request (``wait()`` raises it):
`CollectiveMismatchError` (the group stays usable), `CollectiveTimeoutError` and
`PeerLostError` (the group is aborted, and every later request fails too).

See Also
--------
{name}, wait_all, Request

"""

_PERSISTENT = """\
The arguments are checked and bound here, locally (no communication).  ``p()`` runs the
call and returns what `{name}` returns, the same output array every time (`out`, or one
made here; where the output's shape is the peers' to say, the first call's result);
``p.start()`` posts it (a `Request`); ``p.free()`` releases it.  The bound arrays'
contents may change between calls.

{parameters}Returns
-------
Persistent
    The bound call.

Raises
------
TypeError, ValueError
    The local errors of `{name}`, raised here.  The group stays usable.

See Also
--------
{name}, Persistent

"""


def _section(doc, title):
    """The numpydoc section `title` of a cleaned docstring: its heading, underline and text."""
    lines = doc.splitlines()
    start = lines.index(title)
    end = start + 2
    while end < len(lines) and not (end + 1 < len(lines) and lines[end + 1]
                                    and set(lines[end + 1]) == {"-"}):
        end += 1
    return "\n".join(lines[start:end]).rstrip() + "\n\n"


def _document():
    """Fill in the docstrings: the shared parts (%(op)s ...) of every public method, then the
    sections of each nonblocking (i...) and persistent (..._init) form that its blocking call
    has (its Parameters), before the form's own Examples."""
    for name in PUBLIC + ("split", "dup", "split_by"):
        method = getattr(Front, name)
        doc = inspect.cleandoc(method.__doc__)
        for key, text in _PARTS.items():
            doc = doc.replace(f"%({key})s", text)
        method.__doc__ = doc
    for name in ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "barrier",
                 "alltoall", "gather", "scatter", "scan", "exscan"):
        parameters = _section(getattr(Front, name).__doc__, "Parameters")
        for form, template in (("i" + name, _NONBLOCKING), (name + "_init", _PERSISTENT)):
            method = getattr(Front, form)
            head, examples = method.__doc__.split("Examples\n--------", 1)
            method.__doc__ = (head.rstrip() + "\n\n"
                              + template.format(name=name, parameters=parameters)
                              + "Examples\n--------" + examples)


_document()
