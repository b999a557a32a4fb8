"""Persistent collectives (DESIGN section 11; docs/design.md, "Persistent calls"): a call
checked and bound once (comm.allreduce_init & co.), run many times.

A Persistent holds the call's CallSpec, parsed once with its output bound (out=, or an array
made at init; where the output's shape is the peers' to say - a broadcast rank that passed
None, allgather(axis=0), alltoall(counts=), gather(axis=0), scatter away from the root - the
first call's result, bound from then on).  p() runs it:

- on one machine, a plain ndarray call of an engine collective is one Engine.call with its
  arguments prebound (Communicator._bind: the communicator's usual checks - closed, a forked
  child, nonblocking calls outstanding, in which case it queues behind them - and nothing
  else: no parse, no allocation);
- every other call runs its bound spec through the communicator's dispatch (Front._start),
  as the plain call would after its parse (a fresh deadline when timeout= was given).

p() is the bound function itself: a Persistent is a functools.partial of it (a C callable:
calling an instance of a Python class with __call__ costs about 0.2 µs more, a quarter of a
small allreduce at P = 1), whose function is set again (partial.__setstate__) when the
binding changes (the output learnt from the first call, free()).

p.start() posts the bound spec: a Request.  p.free() (or dropping p) releases the arrays; a
call after free() raises ShmtreeError.
"""
from __future__ import annotations

import functools

from .calls import deadline_of
from ..errors import ShmtreeError

__all__ = ["Persistent", "DECLINED"]


class _Declined:
    __slots__ = ()

    def __repr__(self):
        return "<declined: parse the call first>"


DECLINED = _Declined()


def _unbound():
    raise ShmtreeError("shmtree: this persistent call is not bound")


class Persistent(functools.partial):
    """A collective call bound once: p() runs it, p.start() posts it, p.free() releases it.

    Made by the ``*_init`` forms (``comm.allreduce_init(x, out=x)``, ``shmtree.scan_init(x)``,
    ...), which check and bind the call's arguments once, locally.  ``p()`` returns the call's
    result: the same output array every time (`out`, or one made at init; where the output's
    shape is the peers' to say, the first call's result).  The bound arrays' contents may
    change between calls; every rank must make its calls in the same order, as for any
    collective.  Mismatches, faults and timeouts behave as for the plain call (``timeout=``
    counts from each call).  A Persistent cannot be pickled.

    Attributes
    ----------
    name : str
        The collective (``"allreduce"``, ...).

    Examples
    --------
    >>> import numpy as np, shmtree
    >>> def step(comm):
    ...     grad = np.empty(3)
    ...     p = comm.allreduce_init(grad, out=grad)     # checked and bound once
    ...     sums = []
    ...     for k in range(3):
    ...         grad[...] = comm.rank + k              # the contents may change
    ...         p()                                    # runs the allreduce; returns grad
    ...         sums.append(float(grad[0]))
    ...     req = p.start()                            # posted: a Request
    ...     req.wait()
    ...     p.free()                                   # a later p() raises ShmtreeError
    ...     return sums, p.freed
    >>> shmtree.run(step, 2)
    [([1.0, 3.0, 5.0], True), ([1.0, 3.0, 5.0], True)]
    """

    __slots__ = ("name", "_comm", "_spec", "_given", "_torch", "_freed")

    def __new__(cls, comm, spec, given=None, torch=False):
        self = super().__new__(cls, _unbound)
        self.name = spec.name
        self._comm = comm
        self._given = given           # out= of another library, returned as given
        self._torch = torch           # torch input without out=: a tensor over the output
        self._freed = False
        self._bound(spec)
        return self

    def _bound(self, spec):
        """Bind spec: p() becomes its engine call (Communicator._bind) or the dispatch."""
        self._spec = spec
        if self._torch and spec.out is not None:
            from ..arrays import _to_torch
            self._given = _to_torch(spec.out)
        run = self._comm._bind(spec, self._slow) if spec.error is None else None
        if run is None:
            run = self._slow
        elif self._given is not None:
            given, bare = self._given, run
            run = lambda: None if bare() is None else given      # noqa: E731
        self._set(run)

    def _set(self, fn):
        self.__setstate__((fn, (), None, None))

    def _slow(self):
        """The bound spec through the communicator's dispatch (Front._start)."""
        spec = self._spec
        if spec is None:
            raise ShmtreeError(f"shmtree: this persistent {self.name} was freed")
        if spec.timeout is not None:
            spec = spec._replace(deadline=deadline_of(spec.timeout))
        got = self._comm._start(spec)
        if spec.out is None and got is not None and spec.error is None:
            self._bound(self._spec._replace(out=got))      # (its shape came from the peers)
        return got if self._given is None or got is None else self._given

    def start(self):
        """Post the call: a Request.

        Persistent calls follow the issue order like any call.

        Returns
        -------
        Request
            Its result is what ``p()`` returns (numpy's view of an `out` of another library).

        Raises
        ------
        ShmtreeError
            The call was freed.
        """
        spec = self._spec
        if spec is None:
            raise ShmtreeError(f"shmtree: this persistent {self.name} was freed")
        spec = spec._replace(posted=True, deadline=deadline_of(spec.timeout))
        request = self._comm._start(spec)
        if spec.out is None and spec.error is None:
            request.add_done_callback(self._learn)
        return request

    def _learn(self, request):
        """A posted call's output, bound for the next calls (when the peers said its shape)."""
        if request.exception() is None and self._spec is not None and self._spec.out is None:
            got = request.result()
            if got is not None:
                self._bound(self._spec._replace(out=got))

    def free(self):
        """Release the bound arrays; later calls raise ShmtreeError.

        Dropping the Persistent does the same.
        """
        self._spec = self._given = None
        self._freed = True
        self._set(self._slow)

    @property
    def freed(self) -> bool:
        """Whether `free` was called."""
        return self._freed

    def __reduce__(self):
        raise TypeError("shmtree: a Persistent cannot be pickled (it is bound to this rank's "
                        "communicator and arrays)")

    def __repr__(self):
        state = "freed" if self._freed else "bound"
        return f"<shmtree.Persistent {self.name} {state}>"
