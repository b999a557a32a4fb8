"""ProcessGroupShmtree's point-to-point operations (a mixin of the backend class, backend.py):
send, recv, recv from any source, each one shmtree message."""
from __future__ import annotations

from torch.futures import Future

from ..p2p.methods import _rank_arg
from ..p2p.records import ANY_SOURCE
from .options import QUICK_P2P_BYTES
from .tensors import _p2p_bytes, _single_p2p
from .works import _DoneWork, _LazyRecvWork, _PostedWork, _settle


class _PointToPoint:
    """ProcessGroupShmtree's point-to-point operations: shmtree's messages (isend / irecv)."""

    # ---- point-to-point: shmtree's messages (isend / irecv), always posted ----

    def send(self, tensors, dstRank, tag=0):
        """send([tensor], dst, tag): the tensor's bytes, as one shmtree message; the Work is
        done once the message is out (the tensor may then change).  A small message that fits
        in the channel's ring now, with nothing else on its way to dst, is written there at
        once (done: no hand-off to the progress thread); any other is posted (isend)."""
        t, tag = _single_p2p("send", tensors, tag)
        buf = _p2p_bytes(t)
        comm = self._comm
        if buf.nbytes <= QUICK_P2P_BYTES:
            self._check_failed()
            with self._issuing:
                self._post_lazy()
                try:
                    sent = comm._p2p().quick_send(buf, _rank_arg(comm, dstRank, "dest"), tag)
                except Exception as exc:          # (torch's C++ takes RuntimeErrors)
                    raise RuntimeError(f"{type(exc).__name__}: {exc}") from None
            if sent:
                return _DoneWork([t])
        return self._p2p(lambda: comm.isend(buf, dstRank, tag=tag), lambda: [t])

    def recv(self, tensors, srcRank, tag=0):
        """recv([tensor], src, tag): the next message from src with that tag, into the tensor
        (as many bytes as it holds: a sender's dtype or shape may differ, as with gloo).
        A small one (at most QUICK_P2P_BYTES) is not posted at once: its Work receives it in
        the caller's thread when waited for with no timeout (dist.recv: no hand-offs between
        threads), and posts it (irecv) the moment anything else is asked of it or of this
        process group (another operation, get_future, is_completed, a wait with a timeout):
        so at most one receive is held back, and a sender never waits for it (its message
        fits in the ring once the receives before it are posted)."""
        t, tag = _single_p2p("recv", tensors, tag)
        try:
            src = _rank_arg(self._comm, srcRank, "source")
        except (TypeError, ValueError) as exc:  # (torch's C++ takes RuntimeErrors)
            raise RuntimeError(f"{type(exc).__name__}: {exc}") from None
        return self._recv(t, src, tag)

    def recv_anysource(self, tensors, tag=0):
        """recv_anysource([tensor], tag) (torch.distributed.recv / irecv with src=None): the
        next message with that tag from any rank, into the tensor, as recv's; the Work's
        _source_rank() is the sender's rank once it is done (-1 before, as gloo's).  Messages
        of one sender arrive in the order sent; receives match in the order they were issued
        (shmtree's ANY_SOURCE)."""
        t, tag = _single_p2p("recv_anysource", tensors, tag)
        return self._recv(t, ANY_SOURCE, tag)

    def _recv(self, t, src, tag):
        """recv and recv_anysource (src: a rank or ANY_SOURCE, checked)."""
        buf = _p2p_bytes(t)
        comm = self._comm
        if buf.nbytes <= QUICK_P2P_BYTES:
            self._check_failed()
            with self._issuing:
                self._post_lazy()
                self._lazy = work = _LazyRecvWork(self, t, buf, src, tag)
            return work
        work = self._p2p(lambda: comm.irecv(src, tag=tag, out=buf), lambda: [t])
        work._recv_from = src
        return work

    def _post_lazy(self):
        """Post the held-back small receive, if any (under self._issuing)."""
        lazy = self._lazy
        if lazy is not None:
            self._lazy = None
            lazy._post()

    def _p2p(self, start, finish):
        """A message, posted: start() gives its Request (shmtree's isend / irecv); the Work's
        future gets finish()'s value once it is done.  Never blocking: batch_isend_irecv's
        sends and receives are issued one after the other before anyone waits."""
        self._check_failed()
        with self._issuing:
            self._post_lazy()
            return self._p2p_post(start, finish)

    def _p2p_post(self, start, finish):
        """_p2p's posting (under self._issuing)."""
        source = Future()
        requests = []
        work = _PostedWork(requests, source, source.then(_settle), self)
        complete = self._completion(work, requests, source, finish)
        try:
            requests.append(start())
        except Exception as exc:                  # (torch's C++ takes RuntimeErrors)
            raise RuntimeError(f"{type(exc).__name__}: {exc}") from None
        requests[-1].add_done_callback(lambda _: self._complete(complete))
        return work
