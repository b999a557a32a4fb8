"""shmtree.Accumulator: an exact, order-independent sum of floats (docs/design.md,
"Reproducible sums").

Every term is held exactly, as a fixed-point integer per element (shmtree/_accum.pyx: 52-bit
int64 limbs above the element's lowest bit), so the sum cannot depend on the order of the
terms, on how they were split between ranks, on the number of ranks or on the tree: integer
addition is associative.  result() rounds the exact sum once, to nearest even: the correctly
rounded sum, bit for bit math.fsum's for float64 terms whose sum is finite.

This module is local (no communication): comm.allreduce(acc) merges the accumulators of every
rank (shmtree/repro.py).
"""
from __future__ import annotations

import numpy as np

from . import _accum, _rounding
from .arrays import as_numpy, is_foreign

__all__ = ["Accumulator"]

# the formats result() rounds to: (bits of precision, smallest and largest normal exponent)
_FORMATS = {"float64": (53, -1022, 1023), "float32": (24, -126, 127),
            "float16": (11, -14, 15), "bfloat16": (8, -126, 127)}
_REAL = {"complex64": "float32", "complex128": "float64"}
_NAMES = "float16, bfloat16, float32, float64, complex64, complex128"


def _real_dtype(dt):
    """The dtype of an accumulator's real parts (complex: its parts'), or TypeError."""
    return _format(dt)[0]


def _format(dt):
    """(the dtype of dt's real parts, its bits of precision, its least and greatest normal
    exponents), or TypeError; remembered per dtype (a dtype's .name is a Python property that
    costs more than the rest of a small call)."""
    got = _TAKEN.get(dt)
    if got is not None:
        return got
    name = dt.name
    real = np.dtype(_REAL[name]) if name in _REAL else dt
    if real.name not in _FORMATS or not (dt.isnative and dt.fields is None):
        raise TypeError(f"shmtree: Accumulator sums floats ({_NAMES}), not {dt}")
    got = _TAKEN[dt] = (real,) + _FORMATS[real.name]
    return got


_TAKEN = {}


def accumulable(dtype) -> np.dtype:
    """dtype as np.dtype, when an Accumulator takes it (else TypeError)."""
    dt = np.dtype(dtype)
    _real_dtype(dt)
    return dt


class Accumulator:
    """An exact sum of floats, the same bits however its terms are ordered or split.

    Holds, for every element of an array of a fixed `shape`, the exact sum of every value
    added to it (a fixed-point integer per element: no rounding at all).  Integer addition is
    associative, so the sum - and the bits of `result`, which rounds it once - is the same
    for any order of the terms, any partition of them between accumulators or ranks, any
    number of ranks, tree or schedule.  ``comm.allreduce(acc)`` (and ``iallreduce``) merges
    the accumulators of every rank into the Accumulator of all their values;
    ``comm.allreduce(x, reproducible=True)`` is ``comm.allreduce(Accumulator.of(x[None]))
    .result()``.

    Parameters
    ----------
    shape : int or tuple of int, default ()
        The shape of the sums.
    dtype : data-type, default float64
        float16, bfloat16 (``ml_dtypes.bfloat16``), float32, float64, complex64 or complex128:
        the dtype of the values and of `result` (complex: the real and imaginary parts are
        summed apart).  float16 and bfloat16 values are widened to float32, exactly.

    Notes
    -----
    - **Exact:** every finite term is kept exactly, whatever its magnitude (1e308 and 1e-308
      together too); `result` rounds the exact sum once, to nearest even: the correctly
      rounded sum.  For float64 terms whose sum is finite that is bit for bit
      ``math.fsum``'s.  The error bound is half an ulp of the result.
    - **Non-finite terms, as math.fsum:** a NaN gives NaN; +inf (or -inf) gives +inf (-inf);
      +inf and -inf together give NaN, and ``result()`` raises ValueError as ``math.fsum``
      does; a finite sum beyond the dtype's range rounds to an infinity, and ``result()``
      raises OverflowError as ``math.fsum`` does (``result(strict=False)`` returns these NaNs
      and infinities instead).  Unlike ``math.fsum``, no partial sum ever overflows: ``[1e308,
      1e308, -1e308]`` sums to 1e308.
    - **Zeros:** a zero sum is -0.0 when every term was -0.0 (as IEEE 754 addition gives in
      any order), else +0.0; no term: +0.0.
    - **Size:** an element takes ``W`` int64 words of 52 bits each, where ``W`` covers the
      span from the lowest bit of its smallest term to the top of its sum (typically 2; every
      element of an accumulator has the most any element needs).

    Examples
    --------
    >>> import numpy as np, shmtree
    >>> acc = shmtree.Accumulator.of(np.array([1e16, 1.0, -1e16]))
    >>> float(acc.result()), float(np.sum([1e16, 1.0, -1e16]))
    (1.0, 0.0)
    >>> def step(comm):
    ...     values = np.arange(12.0) / 7                       # split among the ranks
    ...     mine = values[comm.rank::comm.size]
    ...     acc = comm.allreduce(shmtree.Accumulator.of(mine))
    ...     return float(acc.result())
    >>> shmtree.run(step, 3) == [float(shmtree.Accumulator.of(np.arange(12.0) / 7)
    ...                                .result())] * 3
    True
    """

    __slots__ = ("_dtype", "_shape", "_q", "_limbs", "_flags", "_nonempty")

    def __init__(self, shape=(), dtype=np.float64):
        dt = np.dtype(dtype)
        _real_dtype(dt)
        shape = (int(shape),) if np.isscalar(shape) else tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"shmtree: Accumulator: negative dimensions in shape {shape}")
        self._dtype = dt
        self._shape = shape
        n = _real_size(shape, dt)
        self._q = np.full(n, _accum.QNONE, np.int16)
        self._limbs = np.zeros((n, 1), np.int64)
        self._flags = np.zeros(n, np.uint8)
        self._nonempty = False

    # ---- making and adding ----

    @classmethod
    def of(cls, values, axis=0, dtype=None) -> "Accumulator":
        """The exact sums of `values` along `axis`.

        Parameters
        ----------
        values : array_like
            Floats of a dtype an Accumulator takes (or any array when `dtype` is given and
            its values convert to it exactly: ``np.can_cast(values.dtype, dtype, "safe")``).
            Arrays of other libraries (torch tensors) are read through numpy's view of them.
        axis : int or None, default 0
            The axis whose values are the terms (None: every value is a term of one sum).
        dtype : data-type, optional
            The accumulator's dtype (default: the values').

        Returns
        -------
        Accumulator
            Of shape ``values.shape`` without `axis` (``()`` for ``axis=None``).

        Raises
        ------
        TypeError
            A dtype the Accumulator does not take, or values that would not convert exactly.
        ValueError
            `axis` out of range.
        """
        a, dt = _terms(values, dtype)
        parts = (2,) if dt.kind == "c" else ()        # (complex: a last axis of its parts)
        ndim = a.ndim - len(parts)
        if axis is None:
            a = a.reshape((-1,) + parts)
            axis = 0
            shape = ()
        else:
            if ndim == 0:
                raise ValueError("shmtree: Accumulator.of: a 0-d array has no axis; pass "
                                 "axis=None")
            axis = _axis(axis, ndim)
            shape = a.shape[:axis] + a.shape[axis + 1:ndim]
        self = cls.__new__(cls)
        self._dtype = dt
        self._shape = tuple(shape)
        m = a.shape[axis]
        real = _as_float64(np.moveaxis(a, axis, 0), dt).reshape(m, _real_size(shape, dt))
        if m == 1:
            self._q, self._limbs, self._flags = _accum.from_values(real[0])
        else:
            self._q, self._limbs, self._flags = _accum.from_terms(real)
        self._nonempty = m > 0
        return self

    @classmethod
    def _of_one(cls, values):
        """of(values[None]): every item one term (reproducible=True), the fast way for a
        float64 array."""
        if type(values) is not np.ndarray or values.dtype != np.float64:
            return cls.of(values[None], axis=0)
        self = cls.__new__(cls)
        self._dtype = values.dtype
        self._shape = values.shape
        self._q, self._limbs, self._flags = _accum.from_values(
            np.ascontiguousarray(values).reshape(-1))
        self._nonempty = True
        return self

    def add(self, values, axis=0) -> "Accumulator":
        """Add terms (in place): `values` along `axis`, or another Accumulator's sums.

        Parameters
        ----------
        values : array_like or Accumulator
            Terms of this accumulator's shape along `axis` (the dtype as for `of`, converted
            to this accumulator's), or an Accumulator of the same shape and dtype.
        axis : int or None, default 0
            As for `of`.

        Returns
        -------
        Accumulator
            This accumulator.

        Raises
        ------
        TypeError, ValueError
            As for `of`; a shape (or an Accumulator's dtype) other than this one's.
        """
        if isinstance(values, Accumulator):
            other = values
            if other._dtype != self._dtype:
                raise TypeError(f"shmtree: Accumulator.add: dtype {other._dtype}, this "
                                f"accumulator's is {self._dtype}")
        else:
            other = Accumulator.of(values, axis, dtype=self._dtype)
        if other._shape != self._shape:
            raise ValueError(f"shmtree: Accumulator.add: sums of shape {other._shape}, this "
                             f"accumulator's are {self._shape}")
        self._set(*merged([self._state(), other._state()]))
        return self

    def __iadd__(self, values):
        return self.add(values)

    # ---- the result ----

    def result(self, strict=True) -> np.ndarray:
        """The sums, each rounded once to nearest even, in this accumulator's dtype.

        Parameters
        ----------
        strict : bool, default True
            Raise as ``math.fsum`` does where +inf met -inf (ValueError) or a sum lies beyond
            the dtype's range (OverflowError); False: NaN and infinities instead.

        Returns
        -------
        ndarray
            Of this accumulator's shape and dtype (0-d for shape ``()``).

        Raises
        ------
        ValueError, OverflowError
            With ``strict=True``, as above.
        """
        return self._result_into(None, None, strict)

    def _result_into(self, flat, dst, strict=True):
        """result(), written into dst (an ndarray of this shape and dtype) when given, through
        flat (dst's float64 items as one C-contiguous row, or None) without a copy."""
        real, p, emin, emax = _format(self._dtype)
        out = flat if flat is not None else np.empty(self._q.shape[0], np.float64)
        invalid, overflow = _rounding.rounded(self._q, self._limbs, self._flags, p, emin, emax,
                                           out)
        if strict and invalid:
            raise ValueError(f"shmtree: Accumulator.result: -inf + inf in {invalid} "
                             f"sum{'s' if invalid > 1 else ''} (as math.fsum raises; "
                             f"result(strict=False) gives NaN)")
        if strict and overflow:
            raise OverflowError(f"shmtree: Accumulator.result: {overflow} sum"
                                f"{'s' if overflow > 1 else ''} beyond the range of {real} "
                                f"(as math.fsum raises; result(strict=False) gives inf)")
        if flat is not None:
            return dst
        got = out.astype(real, copy=False)
        if self._dtype.kind == "c":
            got = got.view(self._dtype)
        got = got.reshape(self._shape)
        if dst is not None:
            dst.reshape(self._shape)[...] = got
            return dst
        return got

    # ---- what it is ----

    @property
    def shape(self):
        """The shape of the sums."""
        return self._shape

    @property
    def dtype(self):
        """The dtype of the values and of the result."""
        return self._dtype

    @property
    def ndim(self):
        return len(self._shape)

    @property
    def size(self):
        return int(np.prod(self._shape, dtype=np.int64))

    @property
    def nbytes(self):
        """The bytes of its state (what an allreduce of it moves, about)."""
        return self._q.nbytes + self._limbs.nbytes + self._flags.nbytes

    def copy(self) -> "Accumulator":
        new = Accumulator.__new__(Accumulator)
        new._set(self._q.copy(), self._limbs.copy(), self._flags.copy(), self._nonempty)
        new._dtype, new._shape = self._dtype, self._shape
        return new

    def __repr__(self):
        return (f"<shmtree.Accumulator shape={self._shape} dtype={self._dtype} "
                f"words={self._limbs.shape[1]}>")

    def __getstate__(self):
        return {name: getattr(self, name) for name in self.__slots__}

    def __setstate__(self, state):
        for name, value in state.items():
            setattr(self, name, value)

    # ---- the state, for the collectives (repro.py) ----

    def _state(self):
        """(q int16[n], limbs int64[n, W], flags uint8[n], nonempty): n real elements."""
        return self._q, self._limbs, self._flags, self._nonempty

    def _set(self, q, limbs, flags, nonempty):
        self._q, self._limbs, self._flags, self._nonempty = q, limbs, flags, bool(nonempty)

    @classmethod
    def _made(cls, shape, dtype, q, limbs, flags, nonempty):
        self = cls.__new__(cls)
        self._dtype, self._shape = dtype, tuple(shape)
        self._set(q, limbs, flags, nonempty)
        return self

    def _like(self, q, limbs, flags, nonempty):
        return Accumulator._made(self._shape, self._dtype, q, limbs, flags, nonempty)


def merged(states):
    """The exact sum of accumulator states (each (q, limbs, flags, nonempty) of one shape):
    (q, limbs, flags, nonempty)."""
    W = max(s[1].shape[1] for s in states)
    n = states[0][0].shape[0]
    qs = np.stack([s[0] for s in states])
    limbs = np.empty((len(states), n, W), np.int64)
    for r, s in enumerate(states):
        if s[1].shape[1] == W:
            limbs[r] = s[1]
        else:
            _accum.realign(s[0], s[1], s[0], limbs[r])      # (the same value, W limbs)
    q, out, flags = _accum.combine(qs, limbs, np.stack([s[2] for s in states]))
    return q, out, flags, any(s[3] for s in states)


def _real_size(shape, dt):
    return int(np.prod(shape, dtype=np.int64)) * (2 if dt.kind == "c" else 1)


def _axis(axis, ndim):
    try:
        ax = int(axis)
    except TypeError:
        raise ValueError(f"shmtree: Accumulator: axis must be an int or None, got "
                         f"{axis!r}") from None
    if not -ndim <= ax < ndim:
        raise ValueError(f"shmtree: Accumulator: axis {axis} is out of range for "
                         f"{ndim}-d values")
    return ax % ndim


def _terms(values, dtype):
    """values as an ndarray (complex: its real view with a last axis of 2 parts), and the
    accumulator's dtype."""
    a = as_numpy(values, "Accumulator") if is_foreign(values) else np.asarray(values)
    if dtype is None:
        dt = np.dtype(a.dtype)
        _real_dtype(dt)
    else:
        dt = accumulable(dtype)
        if a.dtype != dt:
            if not np.can_cast(a.dtype, dt, "safe"):
                raise TypeError(f"shmtree: Accumulator: values of dtype {a.dtype} do not "
                                f"convert to {dt} exactly")
            a = a.astype(dt)
    if dt.kind == "c":
        a = np.ascontiguousarray(a)
        a = a.view(_real_dtype(dt)).reshape(a.shape + (2,))
    return a, dt


def _as_float64(a, dt):
    """The terms as float64 (exactly: every dtype an Accumulator takes fits), C-contiguous."""
    if a.dtype == np.float64:
        return np.ascontiguousarray(a)
    if a.dtype.name == "bfloat16":
        return np.ascontiguousarray(a.astype(np.float32).astype(np.float64))
    return np.ascontiguousarray(a, dtype=np.float64)
