"""The quick ways into one machine's engine: a mixin of Communicator
(communicator.py).  _quick takes a blocking plain-ndarray call straight to Engine.call (the
engine's C twin of the parse); _bind binds a persistent call's engine call once.  Either way
the call is the one the parsed path makes (collectives.py): the same descriptor, the same
algorithm.
"""
from __future__ import annotations

import time
import numpy as np

from .. import _engine
from ..frontend import repro as _repro
from ..groups import session
from ..machine import plan as _plan
from ..codes import (KIND_ALLREDUCE, KIND_BARRIER, KIND_BROADCAST, KIND_REDUCE, KIND_ALLGATHER,
                     KIND_ALLTOALL, KIND_REDUCE_SCATTER, KIND_ROOT_STEP, KIND_GATHER, KIND_SCATTER,
                     KIND_SCAN, KIND_EXSCAN)
from ..frontend import calls
from ..frontend.calls import (ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST, REDUCE, REDUCE_SCATTER,
                              dtype_digest as _dtype_digest)
from ..frontend.collectives import KIND_A2AV, Executors, gather_gathers
from ..frontend.front import DECLINED, Persistent


_ENGINE_RESULT = object()   # (_bound_run: return the engine's result)
_BOUND = (ALLREDUCE, BROADCAST, REDUCE, REDUCE_SCATTER, ALLGATHER, ALLTOALL, calls.BARRIER,
          calls.SCAN, calls.EXSCAN)        # (the engine collectives a Persistent binds)
_DIGESTED = (ALLGATHER, ALLTOALL, calls.SCAN, calls.EXSCAN, calls.GATHER)  # (their descriptors
                                                    # carry the dtype's digest: Engine.call's tag)
_GATHER, _SCATTER = calls.GATHER, calls.SCATTER
_KINDS = (KIND_ALLREDUCE, KIND_BROADCAST, KIND_REDUCE, KIND_REDUCE_SCATTER, KIND_ALLGATHER,
          KIND_ALLTOALL, KIND_BARRIER, KIND_GATHER, KIND_SCATTER, KIND_SCAN, KIND_EXSCAN)
                                                   # (by collective number: calls.ALLREDUCE ...)


class _Quick:
    """Communicator's _quick and _bind hooks (front.py) and what they share."""

    # ---- the front end's hooks (front.py): every public collective comes through them ----

    def _quick(self, coll, array, op, out, root, timeout):
        """The engine's C twin of the parse (Engine.call), for a blocking call when no
        nonblocking call is outstanding: the result, or DECLINED (nothing has run: the call is
        parsed and run by _run).  The deadline is only computed when the call outlasts its
        first time slice (a clock read less on the hot path)."""
        eng = self._engine
        if self._gen != session._fork_gen or self._closed or self.group._closed:
            return DECLINED
        progress = self._progress
        if progress is not None and (progress.outstanding or progress.is_current_thread()):
            return DECLINED
        if coll == _SCATTER:                  # (axis=None: front.scatter)
            if type(root) is not int or not 0 <= root < self.size:
                return DECLINED
            kind = KIND_SCATTER + KIND_ROOT_STEP * root
            a = array if self.rank == root else None
            got = self._quick_call(eng, calls.SCATTER, a, out, None, kind, timeout,
                                   _engine.SCATTER_ROWS, root=root)
            if type(got) is tuple:            # (what the round left to Python: rare)
                return self._scatter_rest(got, a, out, root, _engine.SCATTER_ROWS, kind,
                                          None if timeout is None
                                          else time.monotonic() + timeout)
            return got
        tag = 0
        away = False                          # (a gather away from its root: no result)
        if coll == BROADCAST or coll == REDUCE:
            if type(root) is not int or not 0 <= root < self.size:
                return DECLINED
        elif coll in _DIGESTED:               # allgather, alltoall, scan, exscan, gather
            if type(array) is not np.ndarray:
                return DECLINED
            if coll == ALLTOALL and op is not None:     # alltoall(counts=): op is the counts
                return self._quick_alltoallv(eng, array, op, out, timeout)
            dt = array.dtype
            if dt is not self._digest_of[0]:  # (numpy's plain dtypes are singletons)
                self._digest_of = (dt, _dtype_digest(dt))
            tag = self._digest_of[1]
            if coll == _GATHER:               # small ones: the one engine allgather of its
                if type(root) is not int or not 0 <= root < self.size or not gather_gathers(
                        array.nbytes, self.size, self._plan.small_bytes):
                    return DECLINED           # executor (Executors._gather), whose blocks
                if root != self.rank:         # the root keeps
                    away = True
                    out = _engine.DISCARD
                elif out is not None and type(out) is not np.ndarray:
                    return DECLINED
        kind = _KINDS[coll] + KIND_ROOT_STEP * root
        try:
            got = eng.call(ALLGATHER if coll == _GATHER else coll, array, out, op, root, kind,
                           timeout, tag)
            if got is None:
                return DECLINED
            result, deadline = self._complete(eng, got, timeout)
        except BaseException as exc:
            self._interrupted(eng, exc)
            raise
        if coll == BROADCAST and type(result) is tuple:
            claim = out if array is None else array
            return self._broadcast_rest(result, claim, root, out, kind, deadline)
        return None if away else result

    def _quick_alltoallv(self, eng, a, counts, out, timeout):
        """_quick of alltoall(counts=): the one engine call the executor makes
        (Executors._alltoall), the counts in its first round; DECLINED where the engine cannot
        take the arguments as they are (the parse then says what is wrong, or normalises)."""
        if not (self._counts_inline or self._counts_travel()):
            return DECLINED
        try:
            got = eng.call(ALLTOALL, a, out, None, 0, KIND_A2AV, timeout, 0, None, counts)
            if got is None:
                return DECLINED
            result, deadline = self._complete(eng, got, timeout)
        except BaseException as exc:
            self._interrupted(eng, exc)
            raise
        if type(result) is tuple:             # (the round says the ranks disagree)
            self._counts_disagree(result[1], a, out, deadline)
        return result

    def _complete(self, eng, got, timeout):
        """A begun engine call (Engine.call's (rc, result)) driven to its end: (its result, its
        deadline for a round that follows it).  The deadline (None without a timeout) is read
        only when it is needed - a call that outlasts its first slice, or a result that says
        more is to come (a tuple) - from the first slice's start (Engine.began), before the
        later slices move it on."""
        rc, result = got
        deadline = None
        if timeout is not None and (rc != _engine.DONE or type(result) is tuple):
            deadline = eng.began() + timeout
        if rc != _engine.DONE:
            result = self._finish(eng, rc, deadline, result)
        return result, deadline

    def _quick_call(self, eng, coll, array, out, op, kind, timeout, tag, dims=None, offs=None,
                    root=0):
        """One engine call of a quick path, driven to its end: its result, or DECLINED."""
        try:
            got = eng.call(coll, array, out, op, root, kind, timeout, tag, dims, offs)
            if got is None:
                return DECLINED
            result = self._complete(eng, got, timeout)[0]
        except BaseException as exc:
            self._interrupted(eng, exc)
            raise
        return result

    def _bind(self, spec, slow):
        """A persistent call's engine call with its arguments bound (persistent.py): for a
        plain ndarray call of an engine collective, a function of no arguments that makes the
        call as _quick would and returns its result, or runs slow() (the bound spec, parsed
        already, through _start) when it cannot: the communicator unusable, nonblocking calls
        outstanding, the engine declining the arrays.  None for the other calls."""
        coll = spec.coll
        a, out, timeout = spec.array, spec.out, spec.timeout
        if spec.reproducible:
            return _repro.bind(self, spec, slow)      # (deterministic=True, Accumulator)
        if coll == calls.GATHER:
            return self._bind_gather(spec, slow)
        if coll == calls.SCATTER:
            return self._bind_scatter(spec, slow)
        if coll == ALLTOALL and spec.counts is not None:
            return self._bind_alltoallv(spec, slow)
        if coll not in _BOUND or (coll == ALLGATHER and spec.axis is not None):
            return None
        if (a is not None and type(a) is not np.ndarray) or \
                (out is not None and type(out) is not np.ndarray):
            return None
        if coll == BROADCAST and a is None and out is None:
            return None                       # (its output is the first call's: not bound yet)
        tag = _dtype_digest(a.dtype) if coll in _DIGESTED else 0
        root = spec.root or 0
        op = (spec.opc, spec.dtc) if spec.opc >= 0 else None
        eng, group, kind = self._engine, self.group, spec.kind
        claim = out if a is None else a

        if timeout is None and coll != BROADCAST:     # (the common case, as short as can be)
            return self._bound_run(coll, a, out, op, root, kind, tag, slow)

        def run():
            if self._closed or group._closed or self._gen != session._fork_gen:
                return slow()
            progress = self._progress
            if progress is not None and (progress.outstanding or progress.is_current_thread()):
                return slow()
            try:
                got = eng.call(coll, a, out, op, root, kind, timeout, tag)
                if got is None:
                    return slow()
                result, deadline = self._complete(eng, got, timeout)
            except BaseException as exc:
                self._interrupted(eng, exc)
                raise
            if type(result) is tuple:         # (a broadcast whose data did not come yet)
                return self._broadcast_rest(result, claim, root, out, kind, deadline)
            return result
        return run

    def _bind_alltoallv(self, spec, slow):
        """_bind of alltoall(counts=) with its out= bound (given, or the first call's result):
        the one engine call of _quick_alltoallv, its arguments prebound."""
        a, out, counts = spec.array, spec.out, spec.counts
        if type(a) is not np.ndarray or type(out) is not np.ndarray \
                or spec.timeout is not None or not self._counts_travel():
            return None
        bound = self._bound_run(ALLTOALL, a, out, None, 0, KIND_A2AV, 0, slow, offs=counts)

        def run():
            result = bound()
            if type(result) is tuple:         # (the round says the ranks disagree)
                self._counts_disagree(result[1], a, out, None)
            return result
        return run

    def _bind_gather(self, spec, slow):
        """_bind of a small gather (axis=None, what Executors._gather runs as one allgather):
        that one engine call, into the root's bound output or a scratch array elsewhere."""
        a, out, P = spec.array, spec.out, self.size
        mine = self.rank == spec.root
        if spec.axis is not None or type(a) is not np.ndarray or spec.timeout is not None \
                or not gather_gathers(a.nbytes, P, self._plan.small_bytes) \
                or (mine and type(out) is not np.ndarray):
            return None
        dst = out if mine else np.empty((P,) + a.shape, a.dtype)
        return self._bound_run(ALLGATHER, a, dst, None, 0, spec.kind, _dtype_digest(a.dtype),
                               slow, dst if mine else None)

    def _bind_scatter(self, spec, slow):
        """_bind of a scatter (axis=None, no timeout): the one engine call of the quick path,
        its round's rare outcomes (a tuple) finished as the quick path does."""
        root, out = spec.root, spec.out
        a = spec.array if self.rank == root else None
        if spec.axis is not None or spec.timeout is not None or (
                self.rank == root and type(a) is not np.ndarray) or type(out) is not np.ndarray:
            return None                       # (out None: the first call's result, bound then)
        bound = self._bound_run(calls.SCATTER, a, out, None, root, spec.kind,
                                _engine.SCATTER_ROWS, slow)

        def run():
            got = bound()
            if type(got) is tuple:
                return self._scatter_rest(got, a, out, root, _engine.SCATTER_ROWS, spec.kind,
                                          None)
            return got
        return run

    def _bound_run(self, coll, a, out, op, root, kind, tag, slow, give=_ENGINE_RESULT,
                   offs=None):
        """A bound call without a timeout (_bind): the communicator's checks (closed, a forked
        child, nonblocking calls outstanding: then slow(), the bound spec through _start), one
        Engine.call (offs: alltoall(counts=)'s counts), and its result - or `give`, when given
        (a gather's output)."""
        eng, group, done = self._engine, self.group, _engine.DONE

        def run():
            progress = self._progress
            if self._closed or group._closed or self._gen != session._fork_gen or (
                    progress is not None and (progress.outstanding
                                              or progress.is_current_thread())):
                return slow()
            try:
                got = eng.call(coll, a, out, op, root, kind, None, tag, None, offs)
                if got is None:
                    return slow()
                result = got[1] if got[0] == done else self._finish(eng, got[0], None, got[1])
            except BaseException as exc:
                self._interrupted(eng, exc)
                raise
            return result if give is _ENGINE_RESULT else give
        return run
