"""The Work objects the backend returns (posted, failed, done, a held-back small recv) and the
calls they run (_call): `work.wait()` and `work.get_future()` behave as gloo's."""
from __future__ import annotations

import concurrent.futures
import datetime

import torch
import torch.distributed as dist
from torch.futures import Future

from ..p2p.records import ANY_SOURCE, Status
from .options import _failed, _raised

_CFuture = torch._C.Future


class _Failed:
    """What the source future of a posted operation carries when the operation failed."""

    __slots__ = ("error",)

    def __init__(self, error):
        self.error = error


def _settle(source):
    """The value of a posted operation's future (a then() of its source): the output
    tensors, or the operation's failure raised, which torch turns into an error of the
    future (an error C++ sees too: DDP's reducer raises it, where a Python exception object
    set as a future's value would be taken for its tensors)."""
    value = source.value()
    if isinstance(value, _Failed):
        raise value.error
    return value


class _PostedWork(dist.Work):
    """The Work of a posted operation: wait() returns once it is done and raises its failure;
    get_future() fails likewise (see _settle)."""

    _recv_from = None                   # a recv's: its source rank, or ANY_SOURCE

    def __init__(self, requests, source, future, pg):
        super().__init__()
        self._requests, self._source, self._future = requests, source, future
        self._pg = pg
        self._error = None              # the failure, set before the source completes

    def _source_rank(self):
        """A recv's source rank: the one it named, or (recv_anysource) the sender's once it is
        done (-1 before, as gloo's); any other operation's: torch's error."""
        src = self._recv_from
        if src is None:
            return super()._source_rank()
        if src != ANY_SOURCE:
            return src
        req = self._requests[-1] if self._requests else None
        status = getattr(req, "status", None) if req is not None and req.done() else None
        return -1 if status is None else status.source

    source_rank = _source_rank

    def wait(self, timeout=None):
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) \
            else timeout
        try:
            self._requests[-1].exception(seconds or None)     # (0: torch's "no timeout")
        except (TimeoutError, concurrent.futures.TimeoutError):     # (one type from 3.11)
            raise RuntimeError(f"shmtree: the operation is not done after {seconds} s "
                               "(Work.wait timed out; it is still running)") from None
        self._source.wait()             # (its completion has run)
        try:
            # and the future's own value is made: the then() of the source runs in the thread
            # that completed it, possibly after the source's waiters were woken
            self._future.wait()
        except Exception:
            if self._error is None:
                raise
        if self._error is not None:
            self._pg._seen(self._error)
            raise _raised(self._error)
        return True

    def get_future(self):
        return self._future

    def is_completed(self):
        return self._future.done()

    def is_success(self):
        return self._future.done() and self._error is None

    def exception(self):
        return self._error

    def result(self):
        self.wait()
        return self._future.wait()

    def synchronize(self):
        pass


class _FailedWork(dist.Work):
    """The Work of an operation that ran at once and failed (a mismatch, a dead peer, a
    timeout): wait() raises its failure and its future is failed (a Work made from a failed
    torch future would report success from wait())."""

    def __init__(self, error, pg):
        super().__init__()
        self._error, self._pg = error, pg
        self._future = Future()
        self._future.set_exception(error)

    def wait(self, timeout=None):
        self._pg._seen(self._error)
        raise _raised(self._error)

    def get_future(self):
        return self._future

    def is_completed(self):
        return True

    def is_success(self):
        return False

    def exception(self):
        return self._error

    def result(self):
        self.wait()

    def synchronize(self):
        pass


class _DoneWork(dist.Work):
    """The Work of an operation done at once: its future (made when asked for: most callers,
    torch.distributed's blocking functions, only wait) holds `value`."""

    def __init__(self, value):
        super().__init__()
        self._value = value
        self._future = None

    def wait(self, timeout=None):
        return True

    def get_future(self):
        fut = self._future
        if fut is None:                           # (torch's C++ Future, which a Work made from
            fut = self._future = _CFuture([])     # a future gives too: the Python subclass's
            fut.set_result(self._value)           # methods cost more)
        return fut

    def is_completed(self):
        return True

    def is_success(self):
        return True

    def exception(self):
        return None

    def result(self):
        return self._value

    def synchronize(self):
        pass


_done = _DoneWork


class _LazyRecvWork(dist.Work):
    """The Work of a small recv (ProcessGroupShmtree.recv): held back until waited for (then
    received in the waiting thread, blocking: shmtree's recv) or until anything else needs it
    posted (then a _PostedWork, which this one forwards to)."""

    def __init__(self, pg, t, buf, src, tag):
        super().__init__()
        self._pg, self._t, self._buf, self._src, self._tag = pg, t, buf, src, tag
        self._posted = None             # the _PostedWork, once posted
        self._done = False              # received here
        self._error = None              # posting it failed (raised by wait)
        self._got_from = -1             # the sender's rank, once received here

    def _post(self):                    # (under the group's _issuing; by _post_lazy)
        comm, buf, src, tag, t = self._pg._comm, self._buf, self._src, self._tag, self._t
        try:
            self._posted = self._pg._p2p_post(lambda: comm.irecv(src, tag=tag, out=buf),
                                              lambda: [t])
            self._posted._recv_from = src
        except RuntimeError as exc:     # (not the failure of whatever made it post)
            self._error = exc

    def _source_rank(self):
        """The sender's rank (gloo's: -1 until received; a recv that named it: that one)."""
        if self._posted is not None:
            return self._posted._source_rank()
        if self._src != ANY_SOURCE:
            return self._src
        return self._got_from

    source_rank = _source_rank

    def _posted_work(self):
        pg = self._pg
        if self._posted is None and not self._done:
            with pg._issuing:
                if pg._lazy is self:
                    pg._post_lazy()
        return self._posted

    def wait(self, timeout=None):
        if timeout is not None:                  # (a wait that may give up: posted)
            self._posted_work()
        pg = self._pg
        if self._posted is None and self._error is None and not self._done:
            with pg._issuing:
                if pg._lazy is self:             # (else posted meanwhile, by another thread)
                    pg._lazy = None
                    status = Status()
                    try:
                        pg._comm.recv(self._src, tag=self._tag, out=self._buf, status=status)
                    except Exception as exc:
                        raise _failed(pg._comm.rank, exc) from None
                    self._got_from = status.source
                    self._done = True
                    return True
        if self._error is not None:
            raise self._error
        if self._posted is not None:
            return self._posted.wait(timeout)
        return True

    def get_future(self):
        posted = self._posted_work()
        if posted is not None:
            return posted.get_future()
        if self._error is not None:
            fut = Future()
            fut.set_exception(self._error)
            return fut
        return _DoneWork([self._t]).get_future()

    def is_completed(self):
        posted = self._posted_work()
        return posted.is_completed() if posted is not None else True

    def is_success(self):
        posted = self._posted_work()
        return posted.is_success() if posted is not None else self._error is None

    def exception(self):
        posted = self._posted_work()
        return posted.exception() if posted is not None else self._error

    def result(self):
        self.wait()
        return [self._t]

    def synchronize(self):
        pass


def _call(parse, comm, *args, **kwargs):
    """A call, as _work makes it: call(True) parses it (parse: calls.allreduce, ...; the
    CallSpec every way into a collective builds; its argument errors raise here) and gives
    the step that runs it blocking, call(False) the step that posts it (a Request): both
    through the front end's one dispatch (Front._start: a rooted call's local error is said
    to the other ranks before it is raised, as the communicator's methods do)."""
    def call(now):
        spec = parse(comm, *args, posted=not now, **kwargs)
        return lambda: comm._start(spec)
    return call
