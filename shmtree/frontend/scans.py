"""The prefix reductions - scan and exscan - with their nonblocking forms: a mixin of Front
(front.py), written once over the communicator's hooks, as every public collective is.
"""
from __future__ import annotations

import numpy as np

from .. import arrays as _arrays
from . import calls
from ..arrays import either_foreign as _foreign, numpy_args as _numpy_args
from .calls import EXSCAN, SCAN
from .persistent import DECLINED


class _Scans:
    """Front's scan and exscan (and their i-forms)."""

    # ---- scan, exscan ----

    def scan(self, array, op="sum", *, out=None, timeout=None, deterministic=False):
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
        deterministic : bool, default False
            Accepted for symmetry with `allreduce`: a scan applies the op in rank order always
            (the bits above); every rank passes the same (else `CollectiveMismatchError` on
            every rank).

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
        if deterministic is not False:   # (rank order always: the same call, said in its kind)
            if _foreign(array, out):
                return _arrays.call(self.scan, array, out, "scan", op, timeout=timeout,
                                    deterministic=deterministic)
            return self._start(calls.scan(self, array, op, out, timeout,
                                            deterministic=deterministic))
        got = self._quick(SCAN, array, op, out, 0, timeout)
        if got is not DECLINED:
            return got
        if _foreign(array, out):
            return _arrays.call(self.scan, array, out, "scan", op, timeout=timeout)
        return self._start(calls.scan(self, array, op, out, timeout))

    def iscan(self, array, op="sum", *, out=None, timeout=None, deterministic=False):
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
        return self._start(calls.scan(self, array, op, out, timeout, posted=True,
                                        deterministic=deterministic))

    def exscan(self, array, op="sum", *, out=None, timeout=None, deterministic=False):
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
        deterministic : bool, default False
            Accepted for symmetry with `allreduce`: a scan applies the op in rank order always
            (the bits above); every rank passes the same (else `CollectiveMismatchError` on
            every rank).

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
        if deterministic is not False:   # (rank order always: the same call, said in its kind)
            if _foreign(array, out):
                return _arrays.call(self.exscan, array, out, "exscan", op, timeout=timeout,
                                    deterministic=deterministic)
            return self._start(calls.exscan(self, array, op, out, timeout,
                                            deterministic=deterministic))
        got = self._quick(EXSCAN, array, op, out, 0, timeout)
        if got is not DECLINED:
            return got
        if _foreign(array, out):
            return _arrays.call(self.exscan, array, out, "exscan", op, timeout=timeout)
        return self._start(calls.exscan(self, array, op, out, timeout))

    def iexscan(self, array, op="sum", *, out=None, timeout=None, deterministic=False):
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
        return self._start(calls.exscan(self, array, op, out, timeout, posted=True,
                                        deterministic=deterministic))
