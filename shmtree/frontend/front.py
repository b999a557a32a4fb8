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

from .. import arrays as _arrays
from . import calls, repro as _repro
from ..arrays import either_foreign as _foreign, numpy_args as _numpy_args
from .calls import (ALLGATHER, ALLREDUCE, ALLTOALL, BARRIER, BROADCAST, EXSCAN, GATHER, REDUCE,
                    REDUCE_SCATTER, SCAN, SCATTER)
from .forms import _Forms, _output  # noqa: F401  (_output: persistent calls' outputs)
from .memory import _Memory, _made_by, _split_maker  # noqa: F401  (subcomm registers)
from .moves import _Moves
from .scans import _Scans
from .persistent import DECLINED, Persistent

__all__ = ["Front", "DECLINED", "PUBLIC", "module_functions", "Persistent"]


class Front(_Moves, _Scans, _Forms, _Memory):
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

    def allreduce(self, array, op="sum", *, out=None, timeout=None, deterministic=False,
                  reproducible=False):
        """Reduce `array` over all ranks with `op`; a new array, or `out` when given.

        A collective: every rank makes the call, with the same shape, dtype and op, and gets the
        same result.  Integer and bitwise results, ``min`` and ``max`` are exact; float and complex
        ``sum`` and ``prod`` are folded in the order of the group's tree or schedule, which may
        differ from numpy's in the last bits (the same bits on every rank, and run to run).  Arrays
        from `empty` / `zeros` (input and `out`) run single-copy.  ``deterministic=True`` folds in
        rank order whatever the plan; ``reproducible=True`` (or an `Accumulator` for `array`)
        sums exactly, the same bits for any number of ranks.

        Parameters
        ----------
        %(array)s
            Its dtype: bool, int8-64, uint8-64, float16/32/64, complex64/128 or bfloat16
            (``ml_dtypes.bfloat16``, ``torch.bfloat16``).  Or an `Accumulator`: every rank's
            is merged, and the result is the Accumulator of all their terms (`op` "sum", no
            `out`).
        %(op)s
        out : ndarray or writable buffer, optional
            Where the result is written: an array of the input's shape and dtype (or a writable
            buffer of as many items).  May be `array` itself (in place) or overlap it.
        %(timeout)s
        %(deterministic)s
        reproducible : bool, default False
            The exact sum of every rank's `array` (each rank's one term), rounded once to nearest
            even: ``allreduce(Accumulator.of(array[None])).result()``.  The same bits for any
            number of ranks, any order of them, any tree or machine.  `op` "sum"; float16,
            bfloat16, float32, float64, complex64, complex128.

        Returns
        -------
        ndarray or Accumulator
            The reduction, of the input's shape and dtype: `out` when given, else a new array
            (a torch tensor when the input is one); for an Accumulator, the merged Accumulator.

        Raises
        ------
        TypeError
            The dtype or the op/dtype pair has no reduction (objects, structured, a bitwise op of
            floats), or `array` is a masked array; ``reproducible=True`` of a dtype other than
            the floats.  %(local)s
        ValueError
            An unknown `op`, an `out` of another shape or dtype or read-only, a negative `timeout`;
            `deterministic` or `reproducible` not a bool, both given, an op other than "sum"
            with ``reproducible=True``.  %(local)s
        OverflowError
            ``reproducible=True``: a sum beyond the dtype's range; ValueError: +inf met -inf
            (as `Accumulator.result` and ``math.fsum`` raise; on every rank).
        %(raises)s

        See Also
        --------
        iallreduce, allreduce_init, reduce, reduce_scatter, scan, Accumulator

        Notes
        -----
        %(deterministic_notes)s

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
        if deterministic is not False or reproducible is not False:
            if deterministic is True and reproducible is False:
                got = _repro.quick(self, ALLREDUCE, array, op, out, 0, timeout)
                if got is not DECLINED:
                    return got
            if _foreign(array, out):
                return _arrays.call(self.allreduce, array, out, "allreduce", op,
                                    timeout=timeout, deterministic=deterministic,
                                    reproducible=reproducible)
            return self._start(calls.allreduce(self, array, op, out, timeout,
                                               deterministic=deterministic,
                                               reproducible=reproducible))
        got = self._quick(ALLREDUCE, array, op, out, 0, timeout)
        if got is not DECLINED:
            return got
        if _foreign(array, out):
            return _arrays.call(self.allreduce, array, out, "allreduce", op, timeout=timeout)
        return self._start(calls.allreduce(self, array, op, out, timeout))

    def iallreduce(self, array, op="sum", *, out=None, timeout=None, deterministic=False,
                   reproducible=False):
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
        return self._start(calls.allreduce(self, array, op, out, timeout, posted=True,
                                           deterministic=deterministic,
                                           reproducible=reproducible))

    # ---- reduce ----

    def reduce(self, array, op="sum", root=0, *, out=None, timeout=None, deterministic=False):
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
        %(deterministic)s

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
        if deterministic is not False:
            if deterministic is True:
                got = _repro.quick(self, REDUCE, array, op, out, root, timeout)
                if got is not DECLINED:
                    return got
            if _foreign(array, out):
                return _arrays.call(self.reduce, array, out, "reduce", op, root,
                                    timeout=timeout, deterministic=deterministic)
            return self._start(calls.reduce(self, array, op, root, out, timeout,
                                            deterministic=deterministic))
        got = self._quick(REDUCE, array, op, out, root, timeout)
        if got is not DECLINED:
            return got
        if _foreign(array, out):
            return _arrays.call(self.reduce, array, out, "reduce", op, root, timeout=timeout)
        return self._start(calls.reduce(self, array, op, root, out, timeout))

    def ireduce(self, array, op="sum", root=0, *, out=None, timeout=None, deterministic=False):
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
        return self._start(calls.reduce(self, array, op, root, out, timeout, posted=True,
                                        deterministic=deterministic))

    # ---- reduce_scatter ----

    def reduce_scatter(self, array, op="sum", *, out=None, timeout=None, deterministic=False):
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
        %(deterministic)s

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
        if deterministic is not False:
            if deterministic is True:
                got = _repro.quick(self, REDUCE_SCATTER, array, op, out, 0, timeout)
                if got is not DECLINED:
                    return got
            if _foreign(array, out):
                return _arrays.call(self.reduce_scatter, array, out, "reduce_scatter", op,
                                    timeout=timeout, deterministic=deterministic)
            return self._start(calls.reduce_scatter(self, array, op, out, timeout,
                                                    deterministic=deterministic))
        got = self._quick(REDUCE_SCATTER, array, op, out, 0, timeout)
        if got is not DECLINED:
            return got
        if _foreign(array, out):
            return _arrays.call(self.reduce_scatter, array, out, "reduce_scatter", op,
                                timeout=timeout)
        return self._start(calls.reduce_scatter(self, array, op, out, timeout))

    def ireduce_scatter(self, array, op="sum", *, out=None, timeout=None,
                        deterministic=False):
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
        return self._start(calls.reduce_scatter(self, array, op, out, timeout, posted=True,
                                                deterministic=deterministic))

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
    "deterministic": """\
deterministic : bool, default False
    Apply the op in rank order, ``x_0 op x_1 op ... op x_{size-1}`` for every element,
    whatever the tree, schedule, message size or machine: the same bits for the same inputs
    on the same number of ranks everywhere (`allreduce`'s Notes give the rule).  Every rank
    passes the same: a rank passing True while another passes False raises
    `CollectiveMismatchError` on every rank.""",
    "deterministic_notes": """\
With ``deterministic=True`` (`allreduce`, `reduce`, `reduce_scatter`) every element is one
fold of the P contributions in rank order, by shmtree's kernels: bit for bit
``ufunc.reduce(np.stack(inputs), axis=0, dtype=dtype)`` (numpy's row-by-row left fold) for
integers, bool, bitwise ops and float32/float64/complex ``sum``, and float32/float64
``prod``.  float16 and bfloat16 ``sum`` and ``prod`` are widened to float32, folded in rank
order in float32 and rounded once: ``ufunc.reduce(np.stack(inputs).astype(np.float32),
axis=0).astype(dtype)``, where numpy rounds after every step.  complex ``prod`` uses the
textbook formula, ``(a*c - b*d) + (a*d + b*c)i``, where numpy's loops may fuse the
multiply-adds: the last bit may differ.  ``min`` and ``max`` follow allreduce's rule (NaN
propagates; -0.0 is below +0.0).  Where the plan's own schedule already folds so (a small
message on one node of at most 8 ranks, a flat tree), the call is the plain one; else one
allgather of every input and a local fold (small messages), or an exchange of blocks, each
folded by one rank, then an allgather.  With ``reproducible=True`` (or an `Accumulator`) the
sum is exact whatever the number of ranks: see `Accumulator`.""",
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
