"""The matching both transports share (messages.Transport on one machine,
internode.remote.Remote between nodes): arrived messages to posted receives, driving, and the
message thread of isend and irecv."""
from __future__ import annotations

import threading
import time

import numpy as np

from ..errors import ShmtreeError
from .records import ANY_SOURCE, ANY_TAG, SLICE_S, _DISCARD, _Kept, _check_out, _consumed


class _Matching:
    """What both transports share (Transport on one machine, remote.Remote between nodes):
    matching arrived messages to posted receives (recvs: source -> posted _Recv in order; kept:
    source -> _Kept in arrival order), driving (run: progress, check, _wait of the transport),
    and the message thread of isend and irecv."""

    THREAD = "shmtree-messages-rank{}"

    def _init_posting(self):
        self.thread = None          # the message thread (isend/irecv)
        self.wake_thread = threading.Condition(threading.Lock())
        self.nonblocking = []       # posted nonblocking ops not yet done
        self.any_recvs = []         # posted receives from ANY_SOURCE, in order (one list for
                                    # good: the native quick path holds it)
        self.posted_count = 0       # receives posted (their posting numbers)
        self.arrived_count = 0      # messages kept (their arrival numbers)

    # ---- posting (under the lock) ----

    def post_recv(self, op):
        """Post a receive: it takes the earliest-arrived kept message it matches (from its
        source; ANY_SOURCE: from any, the first of each source being the one it may take), or
        waits, in posting order, among the receives of its source or of ANY_SOURCE."""
        self.posted_count += 1
        op.seq = self.posted_count
        if op.peer == ANY_SOURCE:
            best = None
            for src, kept in self.kept.items():
                for i, k in enumerate(kept):
                    if k.claimant is None and (k.tag == op.tag or op.tag == ANY_TAG):
                        if best is None or k.order < best[2].order:
                            best = (src, i, k)
                        break             # (a source's later messages may not overtake it)
            if best is None:
                self.any_recvs.append(op)
                return
            src, i, k = best
            op.peer = src
            self._take_kept(op, self.kept[src], i, k)
            return
        kept = self.kept.get(op.peer)
        if kept:
            for i, k in enumerate(kept):
                if (k.tag == op.tag or op.tag == ANY_TAG) and k.claimant is None:
                    self._take_kept(op, kept, i, k)
                    return
        self.recvs.setdefault(op.peer, []).append(op)

    def _take_kept(self, op, kept, i, k):
        op.tag = k.tag
        del kept[i]
        if k.complete:
            self._deliver(op, k.array)
        else:
            k.claimant = op

    def _deliver(self, op, array):
        """A recv op gets a kept message (a private copy)."""
        if op.out is None:
            op.finish(array)
            return
        wrong = _check_out(op.out, array.dtype, array.shape)
        if wrong:
            op.finish(error=_consumed(op, wrong))
        else:
            np.copyto(op.out, array, casting="no")
            op.finish(op.out)

    def _destination(self, src, tag, dtype, shape):
        """A message from src arrives (its description read): (op, kept, dest, out) - the first
        posted recv from src with its tag (None: none, the message is kept, `kept`), the array
        its payload goes into (_DISCARD: op's out does not fit, op failed: the message is
        consumed), and op's out when it is not dest itself (copied into at the end)."""
        posted = self.recvs.get(src)
        op = None
        if posted:
            for i, r in enumerate(posted):
                if r.tag == tag or r.tag == ANY_TAG:
                    op = r
                    break
        anys = self.any_recvs
        if anys:                      # (the first posted of the two receives that take it)
            for j, r in enumerate(anys):
                if r.tag == tag or r.tag == ANY_TAG:
                    if op is None or r.seq < op.seq:
                        op = anys.pop(j)
                        op.peer = src
                        posted = None
                    break
        if posted is not None and op is not None:
            posted.pop(i)
            if not posted:
                del self.recvs[src]
        if op is None:
            self.arrived_count += 1
            k = _Kept(tag, np.empty(shape, dtype), self.arrived_count)
            self.kept.setdefault(src, []).append(k)
            return None, k, k.array, None
        op.tag = tag
        if op.out is None:
            return op, None, np.empty(shape, dtype), None
        wrong = _check_out(op.out, dtype, shape)
        if wrong:
            op.finish(error=_consumed(op, wrong))
            return op, None, _DISCARD, None
        if op.out.flags.c_contiguous:
            return op, None, op.out, op.out
        return op, None, np.empty(shape, dtype), op.out

    def _whole(self, src, op, kept, dest, out):
        """A message from src has arrived whole (as _destination placed it)."""
        if kept is not None:
            kept.complete = True
            if kept.claimant is not None:
                self.kept[src].remove(kept)
                self._deliver(kept.claimant, kept.array)
        elif dest is not _DISCARD:
            if out is not None:
                if out is not dest:
                    np.copyto(out, dest, casting="no")
                op.finish(out)
            else:
                op.finish(dest)

    def _fail_ops(self, exc, op, lost):
        """Fail every posted operation: `op` with exc, the others with `lost`; nothing is
        posted any more (kept messages stay, for later receives)."""
        for o in self.all_ops():
            o.finish(error=exc if o is op else lost)
        self.recvs.clear()
        self.any_recvs.clear()
        for ks in self.kept.values():
            ks[:] = [k for k in ks if k.claimant is None]

    def _stop(self):
        """(close) Fail what is still posted, complete its Requests, end the message
        thread."""
        with self.lock:
            self.closed = True
            self.fail_all(ShmtreeError("shmtree: this communicator is closed"))
            finished = self._finished_requests()
        self._complete(finished)
        with self.wake_thread:
            self.wake_thread.notify()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    # ---- driving ----

    def run(self, ops):
        """Drive the transport until every op of `ops` is done (the caller's thread), completing
        the Requests of nonblocking operations as they finish.  Any exception on the way (an
        interrupt included) may leave messages half-moved: it fails every posted operation and
        aborts the group, as an interrupted collective does."""
        next_check = time.monotonic() + SLICE_S
        moving = False
        try:
            while True:
                with self.lock:
                    moving = True
                    self.progress()
                    done = all(op.done for op in ops)
                    if not done:
                        now = time.monotonic()
                        if now >= next_check or any(op.deadline is not None and
                                                    now >= op.deadline for op in ops):
                            self.check(now)
                            next_check = now + SLICE_S
                            done = all(op.done for op in ops)
                    finished = self._finished_requests()
                    if not done:
                        conds, missing, made = self.conds()
                        budget = SLICE_S
                        for op in ops:
                            if op.deadline is not None:
                                budget = min(budget, max(0.0, op.deadline - now))
                    moving = False
                if finished:
                    self._complete(finished)
                if done:
                    return
                self._wait(conds, missing, made, budget)
        except BaseException as exc:
            if moving or not all(op.done for op in ops):
                self._broken(exc)
            raise

    def _finished_requests(self):
        done = [op for op in self.nonblocking if op.done]
        if done:
            self.nonblocking = [op for op in self.nonblocking if not op.done]
        return done

    @staticmethod
    def _complete(ops):
        for op in ops:
            req = op.request
            if req is None or req.done():
                continue
            if op.error is not None:
                req.set_exception(op.error)
            else:
                if op.kind == "recv":
                    req.status = op.status()     # (before its waiters wake)
                req.set_result(op.result)

    # ---- the message thread (isend, irecv) ----

    def post_nonblocking(self, op, request):
        op.request = request
        self.nonblocking.append(op)
        with self.wake_thread:
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, daemon=True,
                                               name=self.THREAD.format(self.rank))
                self.thread.start()
            self.wake_thread.notify()
        self._wake()                 # (the thread may be waiting for other messages)

    def _loop(self):
        self.ident = threading.get_ident()
        while True:
            with self.wake_thread:
                while not self.nonblocking and not self.closed:
                    self.wake_thread.wait()
                if self.closed and not self.nonblocking:
                    return
                ops = list(self.nonblocking)
            try:
                self.run(ops[:1])
            except BaseException:
                with self.lock:
                    finished = self._finished_requests()
                self._complete(finished)

    def is_current_thread(self):
        return self.thread is not None and threading.get_ident() == getattr(self, "ident", None)
