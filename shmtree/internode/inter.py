"""The inter-node step: MPI (mpi4py) between the leaders of the nodes, on a thread of its own.

A node's leader (its local rank 0) owns a Link: a thread that runs, in the order they were
submitted, the steps that cross the node boundary (an allreduce of one segment of the node's
sum, a broadcast of one segment, an allgatherv), each as nonblocking MPI requests.  While the
link thread waits on MPI (mpi4py releases the GIL), the leader's main thread goes on with the
next segment's intra-node step: that is the pipeline of docs/algorithms.md, "Across nodes".

The allreduce of a segment has a fixed reduction order, whatever MPI's algorithms: the segment
is cut into one piece per node; node j receives everybody's piece j and folds them in node order
(node 0's first), then every node receives every folded piece (a reduce-scatter and an
allgather, point to point).  A small segment is one allgather instead, after which every leader
folds all of it, in the same node order.  Every rank of every node gets the same bits.

Failure travels as a control message: a leader that fails (its node's group aborted, a timeout,
an interrupt) sends CTRL to every leader, itself included; every link waits on its data requests
and on the control receive at once, so a blocked step ends, its job fails, the link aborts its
own node's group and every later job fails at once (the node's members raise PeerLostError).

MPI must provide MPI_THREAD_MULTIPLE (mpi4py asks for it by default): the link thread calls MPI
while the program's own threads may.
"""
from __future__ import annotations

import collections
import os
import re
import threading
import time

import numpy as np

from .. import _kernels
from ..frontend.calls import split_bounds as _pieces
from ..codes import ABORT_FAILED, ABORT_TIMEOUT, ranks_text
from ..errors import CollectiveTimeoutError, PeerLostError, ShmtreeError

__all__ = ["Link"]

TAG_RS, TAG_AG, TAG_CTRL, TAG_X = 11, 12, 13, 14
TAG_EPOCH, TAG_BCAST = 15, 16     # (a link on some ranks of its communicator: peers)
CTRL_BYTES = 512
EPOCH_BYTES = 8             # a control message: the link's epoch, then the failure text
GATHER_BYTES = 256 << 10    # an allreduce step of at most this much (times the nodes) is one
                            # allgather, each leader folding every node's part in node order
CHECK_EVERY = 8             # MPI tests (each followed by a yield of the CPU) per look for a
                            # control message and at this node's own failure (`interrupt`)
IDLE_POLL_S = 0.01          # an idle link looks for a control message this often
WAIT_SLICE_S = 0.05         # the leader waits for a job in slices (deadline, abort checks)
TIMEOUT_ACROSS = re.compile(r"shmtree: rank \d+ timed out in [^;]* across nodes; ")
#                           (another node's timeout, in Spanning's words: its members raise
#                           CollectiveTimeoutError, nodes._leader_timed_out)
P2P_NODES = 8               # up to this many nodes, a link's allgathers are point to point
                            # (as fast at that scale, and a timeout then knows whose part
                            # had not come: LinkTimeout.exact); beyond, MPI's collective
TIMED_OUT = ("shmtree: timed out waiting for the other nodes (the inter-node step of node {} "
             "did not complete)")


class LinkTimeout(CollectiveTimeoutError):
    """A step between the nodes ran past its deadline.  `waiting`: the link's nodes this step
    still waited for (the sources of its receives that had not completed; every other node
    when the step is one collective request of MPI's, which does not say whose part is
    missing), and `exact`: whether that list is exact (point-to-point receives) or a superset.
    Spanning names the global ranks of those nodes and the user's call."""

    def __init__(self, me, waiting, exact):
        super().__init__(TIMED_OUT.format(me))
        self.waiting, self.exact = list(waiting), exact
CLOSE_WAIT_S = 2.0          # close: how long a running step has to end once failed
NAP_AFTER_S = 0.002         # a step that has waited this long for MPI sleeps between polls,
NAP_SHARE = 0.05            # each nap this share of the time waited so far (the answer comes
NAP_MAX_S = 0.001           # at most 5% later) and at most NAP_MAX_S


_KEPT = []      # (communicator, requests, ...) of links closed after a failure: never freed


class Job:
    __slots__ = ("fn", "args", "done", "error", "value", "watch")

    def __init__(self, fn, args, watch=True):
        self.fn, self.args, self.watch = fn, args, watch
        self.done = threading.Event()
        self.error = None
        self.value = None


class _Aborted(Exception):
    pass


class Link:
    """The inter-node step of one node's leader: `comm` joins one leader per node (its rank is
    the node's index; the link owns it and frees it when it closes: pass a Dup of a
    communicator the program uses); `group` is the node's Group (aborted when another node
    fails).  peers: the link's nodes are only some ranks of `comm`, node j being rank
    peers[j], and its messages' tags are offset by `tags` (a child proxy's link, on the
    communicator its family of proxies shares, mailbox.Family: no MPI communicator is made for
    it); its steps are then point to point between the peers, MPI's collectives being over all
    of `comm` (and, `owned` False, the link does not free `comm`)."""

    def __init__(self, comm, group, peers=None, tags=0, owned=True):
        from mpi4py import MPI
        self.MPI = MPI
        self.comm = comm
        self.tags = int(tags)               # added to every tag of the link's messages
        self.owned = owned                  # the link frees comm when it closes
        self.whole = peers is None
        self.peers = list(range(comm.Get_size())) if peers is None else [int(p) for p in peers]
        self.n = len(self.peers)
        self.me = self.peers.index(comm.Get_rank())
        self.group = group
        self._jobs = collections.deque()
        self._cv = threading.Condition()
        self._closing = False
        self._running = False               # a job is running (on the thread, or inline)
        self._deadline = None               # the inline step's (monotonic; None: none)
        self._stale = False                 # an inline step timed out, its requests posted
        self._watch = True                  # the running step looks at `interrupt`
        self.failure = None                 # the text of the first failure, once aborted
        # control messages carry this link's epoch (one value on every leader, fresh per link):
        # a message sent on a communicator freed since, whose context MPI gives to a later
        # one, is not taken for a failure of the later link
        epoch = np.frombuffer(bytearray(os.urandom(EPOCH_BYTES) if self.me == 0
                                        else EPOCH_BYTES), np.uint8)
        if self.n > 1:
            wait_napping(MPI, self._bcast_requests(epoch, 0, TAG_EPOCH))
        self._epoch = bytes(epoch)
        self._ctrl_lock = threading.Lock()  # the control receive is one MPI request: one
        self._ctrl_got = False              # thread at a time acts on it (link thread, inline
                                            # run, close)
        self._ctrl_buf = bytearray(CTRL_BYTES)
        self._ctrl = comm.Irecv([self._ctrl_buf, MPI.BYTE], source=MPI.ANY_SOURCE,
                                tag=self.tags + TAG_CTRL)
        self._sent = []                     # control sends (never waited for)
        self._ctrl_out = None
        self._orphans = []                  # requests of a step ended by a failure, still
                                            # posted: held (mpi4py holds their buffers) until
                                            # MPI is done with them
        # checked while a step waits on MPI: a failure text of this node, else None (by
        # default: this node's group is aborted)
        self.interrupt = self._group_failed
        self._thread = threading.Thread(target=self._loop, name=f"shmtree-link-{self.me}",
                                        daemon=True)
        self._thread.start()

    def _group_failed(self):
        group = self.group
        if group is not None and not group.closed and group.aborted():
            return f"node {self.me}: {group.describe_abort()}"
        return None

    # ---- the leader's side ----

    def submit(self, fn, *args, watch=True) -> Job:
        """Queue fn(self, *args) to run on the link thread after the jobs already queued.
        watch: while it waits on MPI, look at this node's failure (`interrupt`); False for a
        step that needs nothing more of the node (the node's members may even have left its
        group meanwhile, having got all they wanted of it)."""
        job = Job(fn, args, watch)
        if self._stale:
            self.abort(f"node {self.me}: a step between the nodes timed out and was left "
                       "unfinished")
        with self._cv:
            if self.failure is not None:
                job.error = PeerLostError(f"shmtree: {self.failure.removeprefix('shmtree: ')}")
                job.done.set()
                return job
            self._jobs.append(job)
            self._cv.notify()
        return job

    def wait(self, job, deadline=None):
        """The job's value, or its error raised (PeerLostError: another node failed);
        CollectiveTimeoutError once the monotonic `deadline` passes."""
        while not job.done.wait(WAIT_SLICE_S):
            if deadline is not None and time.monotonic() >= deadline:
                raise LinkTimeout(self.me, [j for j in range(self.n) if j != self.me], False)
        if job.error is not None:
            raise job.error
        return job.value

    def run(self, fn, *args, deadline=None, watch=True):
        """fn's value, now: in the calling thread when the link is idle (no thread handoff: the
        latency of a small step), else after the queued jobs.  CollectiveTimeoutError once
        the monotonic `deadline` passes (either way)."""
        if self._stale:
            self.abort(f"node {self.me}: a step between the nodes timed out and was left "
                       "unfinished")
        with self._cv:
            inline = not self._jobs and not self._running and self.failure is None
            if inline:
                self._running = True
        if not inline:
            return self.wait(self.submit(fn, *args, watch=watch), deadline)
        self._deadline = deadline            # (complete() checks it: this step is the only one)
        self._watch = watch
        try:
            return fn(self, *args)
        except _Aborted:
            raise PeerLostError(f"shmtree: {self.failure.removeprefix('shmtree: ')}") from None
        except CollectiveTimeoutError:
            # (its requests stay posted, kept by complete(): the caller aborts the link with
            # the words of its call, as after a timeout in wait(); a link used again without
            # that fails first)
            self._stale = True
            raise
        except BaseException as exc:
            self.abort(f"node {self.me}: the inter-node step failed: {type(exc).__name__}: "
                       f"{exc}")
            raise
        finally:
            self._deadline, self._watch = None, True
            with self._cv:
                self._running = False
                if self._jobs or self._closing:    # (else nobody waits for it: waking the
                    self._cv.notify_all()          # idle link thread cost a thread switch
                                                   # and an MPI test per inline step)

    def abort(self, text):
        """This node failed: tell every leader (this one included) and fail every job."""
        with self._cv:
            if self.failure is not None:
                return
            self.failure = text
            jobs = list(self._jobs)
            self._jobs.clear()
        data = bytearray(self._epoch + text.encode("utf-8", "replace")
                         [:CTRL_BYTES - EPOCH_BYTES - 1])
        data += b"\0" * (CTRL_BYTES - len(data))
        self._ctrl_out = data
        for j in self.peers:
            try:
                self._sent.append(self.comm.Isend([data, self.MPI.BYTE], dest=j,
                                                  tag=self.tags + TAG_CTRL))
            except Exception:
                pass
        for job in jobs:
            job.error = PeerLostError(f"shmtree: {text}")
            job.done.set()

    def close(self):
        """Stop the link thread (after its queued jobs) and free the control receive.  A step
        still running (another thread's inline run) is made to fail first.  After a failure,
        MPI may still hold requests of the step it ended (and control messages may be on their
        way): their buffers and the link's communicator are kept for the life of the process
        (a few segments at most) rather than freed under MPI.  True when it kept them (a
        communicator the link does not own must then not be freed either)."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(10)
            with self._cv:
                self._cv.wait_for(lambda: not self._running, CLOSE_WAIT_S)
            if self._running or self._thread.is_alive():
                self.abort(f"node {self.me}: the link was closed during an inter-node step")
                with self._cv:
                    self._cv.wait_for(lambda: not self._running, CLOSE_WAIT_S)
                self._thread.join(CLOSE_WAIT_S)
        busy = self._running or self._thread.is_alive()
        try:
            with self._ctrl_lock:
                if not self._ctrl_got and not busy and not self._ctrl.Test():
                    self._ctrl.Cancel()
                    self._ctrl.Wait()
                self._ctrl_got = True         # (nothing may act on it any more)
            if not busy:
                self._orphans = [r for r in self._orphans if not r.Test()]
                self._sent = [r for r in self._sent if not r.Test()]
            kept = bool(self._orphans or self._sent or self.failure is not None or busy)
            if kept:
                _KEPT.append((self.comm, self._ctrl, self._ctrl_buf, self._orphans,
                              self._sent, self._ctrl_out))
            elif self.owned:
                self.comm.Free()               # (the link's own communicator)
            self._orphans, self._sent = [], []
        except Exception:
            kept = True
        return kept

    # ---- the link thread ----

    def _loop(self):
        while True:
            with self._cv:
                while (not self._jobs or self._running) and not self._closing:
                    self._cv.wait(IDLE_POLL_S)
                    if not self._jobs and not self._running and self.failure is None \
                            and self._ctrl_arrived():
                        break
                if self._closing and not self._jobs:
                    return
                job = self._jobs.popleft() if self._jobs and not self._running else None
                if job is not None:
                    self._running = True
            if job is None:
                self._on_ctrl()
                continue
            self._watch = job.watch
            try:
                job.value = job.fn(self, *job.args)
            except _Aborted:
                job.error = PeerLostError(f"shmtree: {self.failure.removeprefix('shmtree: ')}")
            except BaseException as exc:         # a bug or an MPI error: fail every node
                job.error = exc
                self.abort(f"node {self.me}: the inter-node step failed: "
                           f"{type(exc).__name__}: {exc}")
            with self._cv:
                self._running = False
                self._cv.notify_all()
            job.done.set()

    def _ctrl_arrived(self) -> bool:
        """Has a control message of this link arrived?  (One of an earlier link that had the
        same context is dropped, and the receive posted again.)"""
        with self._ctrl_lock:
            if self._ctrl_got:
                return False
            try:
                if not self._ctrl.Test():
                    return False
            except Exception:
                return False
            if bytes(self._ctrl_buf[:EPOCH_BYTES]) != self._epoch:
                self._ctrl = self.comm.Irecv([self._ctrl_buf, self.MPI.BYTE],
                                             source=self.MPI.ANY_SOURCE,
                                             tag=self.tags + TAG_CTRL)
                return False
            self._ctrl_got = True
            return True

    def _on_ctrl(self):
        """A control message arrived: another node (or this one) failed."""
        text = bytes(self._ctrl_buf[EPOCH_BYTES:]).split(b"\0", 1)[0].decode("utf-8",
                                                                              "replace")
        own = self.failure is not None
        with self._cv:
            if self.failure is None:
                self.failure = text or "another node failed"
            jobs = list(self._jobs)
            self._jobs.clear()
        for job in jobs:
            job.error = PeerLostError(f"shmtree: {self.failure.removeprefix('shmtree: ')}")
            job.done.set()
        if not own and self.group is not None:    # another node failed: this node's members
                                                  # must stop too (None: a launcher's proxy of
                                                  # a sub-communicator, mailbox.Proxy.split)
            try:
                self.group.abort(ABORT_TIMEOUT if TIMEOUT_ACROSS.match(self.failure)
                                 else ABORT_FAILED, 0, note=self.failure)
            except ShmtreeError:
                pass

    def _timeout(self, reqs, sources):
        """The LinkTimeout of a step whose requests (the ones Testall left: those not done)
        ran past the deadline; sources[i]: the node reqs[i] receives from (None: a send, or a
        collective request)."""
        others = [j for j in range(self.n) if j != self.me]
        if sources is None:
            return LinkTimeout(self.me, others, False)
        waiting = sorted({src for r, src in zip(reqs, sources) if r and src is not None})
        return LinkTimeout(self.me, waiting or others, bool(waiting))

    def complete(self, reqs, sources=None):
        """Wait for MPI requests, or for a control message (then raise _Aborted); this node's
        failure (`interrupt`) is checked every CHECK_EVERY polls.  Requests left posted when this
        raises are kept (with their buffers) until MPI is done with them.  sources: per request,
        the node it receives from, or None (a send): a timeout then names the nodes whose
        messages had not come (else every other node, LinkTimeout.exact False)."""
        MPI = self.MPI
        done = False
        try:
            if self.failure is not None:
                raise _Aborted()
            if self._ctrl_arrived():      # (before a step whose requests could complete at
                self._on_ctrl()           # once, matched with those a failed peer left)
                raise _Aborted()
            polls, start = 0, time.monotonic()
            testall, pause = MPI.Request.Testall, os.sched_yield
            while not testall(reqs):
                # the CPU goes to whoever else can run at every poll: on a machine with more
                # processes (and link threads) than cores, the peer this step waits for is
                # often one of them (spinning first cost ten times the step's time there);
                # the rest of the loop is kept to the bare calls (a poll costs CPU that the
                # node's members doing the in-node steps need).  A step that waits long sleeps
                # between polls: a yield alone leaves the thread runnable, and a launcher's
                # links (one per communicator across nodes) waiting at once took most of the
                # CPU its node's workers needed to reach the step (three launchers of two
                # workers on two cores: 75 of 121 samples of one launcher's threads were
                # these polls)
                pause()
                polls += 1
                if polls % CHECK_EVERY:
                    continue
                _nap(start)
                if self.failure is not None:       # (aborted by another thread)
                    raise _Aborted()
                if self._ctrl_arrived():
                    self._on_ctrl()
                    raise _Aborted()
                if self._watch and self.interrupt is not None:
                    text = self.interrupt()
                    if text:
                        self.abort(text)
                        raise _Aborted()
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    MPI.Request.Testsome(reqs)      # (Testall leaves every request as it was)
                    raise self._timeout(reqs, sources)
            done = True
        finally:
            if not done:
                self._orphans.extend(r for r in reqs if r)
        if self.failure is not None:
            raise _Aborted()

    # ---- the steps (run on the link thread: fn(link, ...)) ----

    def allreduce(self, buf, op, src=None):
        """buf (a 1-d contiguous array, this node's sum) becomes the sum over all nodes, folded
        in node order: a reduce-scatter and an allgather between the leaders.  src: this
        node's sum when it is elsewhere (buf, not overlapping it, then only receives the
        result: no copy of it into buf first)."""
        n, me, MPI = self.n, self.me, self.MPI
        if src is None:
            src = buf
        if n == 1 or buf.size == 0:
            if src is not buf:
                buf[...] = src
            return buf
        if buf.nbytes * n <= GATHER_BYTES:     # small: one allgather, every leader folds all
            every = np.empty((n,) + buf.shape, buf.dtype)
            if self.whole and n > P2P_NODES:
                self.complete([self.comm.Iallgather([_raw(src), MPI.BYTE],
                                                    [_raw(every), MPI.BYTE])])
            else:                              # (point to point between the peers)
                self.exchange([_raw(src)] * n, [_raw(x) for x in every])
            _kernels.reduce_into(buf, list(every), op)
            return buf
        peers = self.peers
        bounds = _pieces(buf.size, n)
        mine = buf[bounds[me]:bounds[me + 1]]
        got = [None] * n
        reqs, sources = [], []
        for j in range(n):
            if j != me:
                got[j] = np.empty_like(mine)
                reqs.append(self.comm.Irecv([_raw(got[j]), MPI.BYTE], source=peers[j],
                                            tag=self.tags + TAG_RS))
                sources.append(j)
        for j in range(n):
            if j != me:
                reqs.append(self.comm.Isend([_raw(src[bounds[j]:bounds[j + 1]]), MPI.BYTE],
                                            dest=peers[j], tag=self.tags + TAG_RS))
                sources.append(None)
        self.complete(reqs, sources)
        got[me] = src[bounds[me]:bounds[me + 1]]
        if mine.size:
            if me == 0 or src is not buf:      # (mine is got[0], or overlaps none of them)
                _kernels.reduce_into(mine, got, op)
            else:
                folded = np.empty_like(mine)
                _kernels.reduce_into(folded, got, op)
                mine[...] = folded
        reqs, sources = [], []
        for j in range(n):
            if j != me:
                reqs.append(self.comm.Irecv([_raw(buf[bounds[j]:bounds[j + 1]]), MPI.BYTE],
                                            source=peers[j], tag=self.tags + TAG_AG))
                reqs.append(self.comm.Isend([_raw(mine), MPI.BYTE], dest=peers[j],
                                            tag=self.tags + TAG_AG))
                sources += [j, None]
        self.complete(reqs, sources)
        return buf

    def bcast(self, buf, root):
        """buf (bytes) from node `root`'s leader to every leader."""
        if self.n > 1 and buf.size:
            self.complete(self._bcast_requests(_raw(buf), root, TAG_BCAST))
        return buf

    def allgatherv(self, send, recv, counts):
        """Every node's `send` (bytes; node j's has counts[j] bytes) into recv, in node order."""
        if self.n == 1:
            recv[:send.size] = send
            return recv
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
        if self.whole and self.n > P2P_NODES:
            self.complete([self.comm.Iallgatherv(
                [_raw(send), self.MPI.BYTE],
                [_raw(recv), (list(map(int, counts)), displs), self.MPI.BYTE])])
        else:                                  # (point to point between the peers)
            raw = _raw(recv)
            self.exchange([_raw(send)] * self.n,
                          [raw[d:d + int(c)] for d, c in zip(displs, counts)])
        return recv

    # ---- collectives over the peers (a link on some ranks of its communicator) ----

    def _bcast_requests(self, buf, root, tag):
        """An MPI broadcast of buf (uint8) from node `root` over the link's nodes: one
        request over the whole communicator, else the root's sends to each peer (or this
        node's receive from the root)."""
        MPI, peers, tag = self.MPI, self.peers, self.tags + tag
        if self.whole:
            return [self.comm.Ibcast([buf, MPI.BYTE], root=root)]
        if self.me != root:
            return [self.comm.Irecv([buf, MPI.BYTE], source=peers[root], tag=tag)]
        return [self.comm.Isend([buf, MPI.BYTE], dest=p, tag=tag)
                for j, p in enumerate(peers) if j != root]

    def exchange(self, send, recv):
        """Blocks between the leaders, point to point: send[j] (a contiguous uint8 array) to
        node j, recv[j] (its size known beforehand: node j's send[me]) from node j; an empty
        one posts nothing, so a pair with nothing to move costs no message (a gather's or a
        scatter's step involves only the root's node and each other node).  send[me] is
        copied into recv[me].  Every leader's steps follow the same order on this link, and
        MPI does not let messages of one pair overtake each other: a step's receives match its
        own sends."""
        MPI, me, peers = self.MPI, self.me, self.peers
        reqs, sources = [], []
        for j in range(self.n):
            if j != me and recv[j].size:
                reqs.append(self.comm.Irecv([_raw(recv[j]), MPI.BYTE], source=peers[j],
                                            tag=self.tags + TAG_X))
                sources.append(j)
        for j in range(self.n):
            if j != me and send[j].size:
                reqs.append(self.comm.Isend([_raw(send[j]), MPI.BYTE], dest=peers[j],
                                            tag=self.tags + TAG_X))
                sources.append(None)
        if recv[me].size:
            recv[me][...] = send[me]
        if reqs:
            self.complete(reqs, sources)
        return recv


_RANKS = re.compile(r"\b(ranks?) (\d+(?:,\d+)*)\b")


def wait_napping(MPI, reqs):
    """Wait for MPI requests as a step does (yielding, then napping), never inside a blocking
    MPI call: a launcher has threads for each communicator across nodes (links, relays), and
    a blocking call spins in MPI while it waits for the other launchers, taking a core and
    MPI's lock from the others."""
    testall, polls, start = MPI.Request.Testall, 0, time.monotonic()
    while not testall(reqs):
        os.sched_yield()
        polls += 1
        if polls % CHECK_EVERY == 0:
            _nap(start)


def _nap(start):
    """A wait that began at `start` (monotonic) and has gone on for NAP_AFTER_S sleeps a
    while: NAP_SHARE of the time waited so far, at most NAP_MAX_S."""
    waited = time.monotonic() - start
    if waited >= NAP_AFTER_S:
        time.sleep(min(NAP_MAX_S, waited * NAP_SHARE))


def global_ranks(text, ranks, also=None):
    """`text` (a message of a node's own group, whose 'rank r' / 'ranks a,b' are local ranks)
    with the global ranks `ranks[r]` instead (and `also`, a function of text, applied).  What
    another node said, quoted in it as "(node ...)", is in global words already and stays as
    it is."""
    def ranks_sub(part):
        part = _RANKS.sub(sub, part)
        return also(part) if also is not None else part

    def sub(m):
        rs = [int(r) for r in m.group(2).split(",")]
        return ranks_text([ranks[r] if 0 <= r < len(ranks) else r for r in rs])
    out, at = [], 0
    while True:
        quote = text.find("(node ", at)
        if quote < 0:
            out.append(ranks_sub(text[at:]))
            return "".join(out)
        out.append(ranks_sub(text[at:quote]))
        depth, end = 0, quote
        while end < len(text):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            end += 1
            if depth == 0:
                break
        out.append(text[quote:end])
        at = end


def _raw(a):
    """The bytes of a contiguous array (any dtype, bfloat16 included) for MPI.BYTE."""
    return a.reshape(-1).view(np.uint8)
