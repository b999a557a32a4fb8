"""Collectives across nodes: a node's shared-memory group plus MPI between the nodes' leaders.

`from_mpi(mpi_comm, node_size=None)` (docs/design.md, "Across nodes (MPI)"): the processes of an
MPI job that share a node form a shmtree group of their own (one creates the segment, the others
attach through a rendezvous token: same user only), local rank 0 of each node is its leader and
owns the inter-node Link (shmtree.inter), and the communicator returned spans every node:

    rank, size          global (rank == mpi_comm.rank)
    node, nodes         this node's index (nodes ordered by their smallest global rank), count
    node_rank, node_size

Every collective is hierarchical (docs/algorithms.md, "Across nodes"):
  1. agreement: every rank's description of the call (kind, root, op, dtype, shape) is gathered
     in the node, exchanged between the leaders and broadcast back, so that a mismatch anywhere
     raises CollectiveMismatchError on every rank of every node, naming global ranks, before
     any data moves (the group stays usable);
  2. the data, segment by segment (SEGMENT_BYTES): reduce to the leader in the node, the
     inter-node step on the leader's link thread, broadcast in the node; the leader's main
     thread works on segment i+1 in the node while its link thread carries segment i between
     the nodes, so a large message costs about the larger of the two steps, not their sum.

The reduction order is fixed by this plan (the node's own tree order, then nodes in order), not
by MPI: the same bits on every rank of every node.

The same communicator serves the launcher-per-node way in (Group / run / Pool with inter=,
`start_proxy` and `spanning_member` below): there the leader's link is a ProxyLink to its
launcher (shmtree.mailbox) instead of MPI in the leader itself.
"""
from __future__ import annotations

import atexit
import os
import re
import time
import weakref

import numpy as np

from . import arrays as _arrays, communicator as _communicator
from .codes import (ABORT_FAILED, KIND_ALLGATHER, KIND_ALLREDUCE, KIND_BARRIER, KIND_BROADCAST,
                    KIND_NAMES, KIND_REDUCE, KIND_REDUCE_SCATTER, ranks_text)
from .collectives import (_deadline, _dtype_digest, _finish, _movable, _out_for, _root,
                          _scatter_block)
from .errors import CollectiveMismatchError, PeerLostError, ShmtreeError
from .group import Group
from .inter import Link, _pieces, global_ranks
from .ops import OP_NAMES, reduction_codes

__all__ = ["from_mpi", "Spanning"]

SEGMENT_BYTES = 4 << 20        # bytes per pipelined segment across the node boundary
ROW = 10                       # int64 per rank in the agreement table
LANES_BYTES = 4 << 20          # from_mpi, nodes of one size: reductions from this size are
                               # cut among the lanes (_reduce_lanes), smaller ones run whole on
                               # every lane after the node's allreduce (_reduce_small_lanes)
_REDUCE0 = KIND_REDUCE         # reduce to local rank 0 (the leader)
_ALIVE = weakref.WeakSet()     # communicators to close before MPI finalizes
# a node's own step in its messages ("broadcast(root=0) #2"), and the messages of the links
# (already in the words of the whole communicator)
_STEP = re.compile(r"\b(?:allreduce|barrier|allgather|reduce_scatter|"
                   r"(?:broadcast|reduce)\(root=\d+\)) #\d+")
_FROM_LINK = re.compile(r"shmtree: (node \d|timed out waiting for the other nodes)")


class Spanning:
    """A communicator across nodes: the node's shmtree group and MPI between the leaders.  The
    calls and their semantics are those of shmtree.Communicator (allreduce, broadcast, reduce,
    allgather, reduce_scatter, barrier, their i-forms); ranks are global."""

    def __init__(self, local, link, rank, nodes_ranks, node, segment_bytes=SEGMENT_BYTES,
                 lane=None):
        self.local = local
        self.group = local.group
        self._link = link
        self._lane = lane                # from_mpi with nodes of one size: this rank's Link to
                                         # the ranks of its local rank on the other nodes
        self.rank = int(rank)
        self._members = [list(m) for m in nodes_ranks]   # global ranks of each node, by local rank
        self.size = sum(len(m) for m in self._members)
        self.node = int(node)
        self.nodes = len(self._members)
        self.node_rank = local.rank
        self.node_size = local.size
        self._segment = int(segment_bytes)
        self._order = [g for m in self._members for g in m]           # node order -> global
        self._where = {g: (n, r) for n, m in enumerate(self._members) for r, g in enumerate(m)}
        self._in_order = self._order == list(range(self.size))
        self._scratch = None
        self._closed = False
        self._calls = 0                  # the user's calls on this communicator (for messages)
        self._in_call = None             # the one running
        for link in {link, lane} - {None}:
            if isinstance(link, Link):   # (a from_mpi link: this node's failure in global ranks)
                link.interrupt = self._node_failed
        if self.nodes == 1:          # one node: its own communicator makes every call
            for name in ("allreduce", "iallreduce", "reduce", "ireduce", "reduce_scatter",
                         "ireduce_scatter", "broadcast", "ibroadcast", "allgather",
                         "iallgather", "barrier", "ibarrier"):
                setattr(self, name, getattr(local, name))
        _ALIVE.add(self)

    # the module-level calls see this object through shmtree.current()
    @property
    def _gen(self):
        return self.local._gen

    def __repr__(self):
        return (f"<shmtree.Spanning rank={self.rank} size={self.size} node={self.node}/"
                f"{self.nodes} node_rank={self.node_rank}/{self.node_size}>")

    # ---- public calls ----

    def allreduce(self, array, op="sum", *, out=None, timeout=None):
        if _arrays.either_foreign(array, out):
            return _arrays.call(self.allreduce, array, out, "allreduce", op, timeout=timeout)
        return self._now(self._prep_reducing(array, op, out, timeout, None, "allreduce"))

    def iallreduce(self, array, op="sum", *, out=None, timeout=None):
        array, out = _arrays.numpy_args(array, out, "iallreduce")
        return self._post(self._prep_reducing(array, op, out, timeout, None, "allreduce"),
                          "iallreduce")

    def reduce(self, array, op="sum", root=0, *, out=None, timeout=None):
        if _arrays.either_foreign(array, out):
            return _arrays.call(self.reduce, array, out, "reduce", op, root, timeout=timeout)
        root = _root(root, self.size)
        return self._now(self._prep_reducing(array, op, out if self.rank == root else None,
                                             timeout, root, "reduce"))

    def ireduce(self, array, op="sum", root=0, *, out=None, timeout=None):
        array, out = _arrays.numpy_args(array, out, "ireduce")
        root = _root(root, self.size)
        return self._post(self._prep_reducing(array, op, out if self.rank == root else None,
                                              timeout, root, "reduce"), "ireduce")

    def reduce_scatter(self, array, op="sum", *, out=None, timeout=None):
        if _arrays.either_foreign(array, out):
            return _arrays.call(self.reduce_scatter, array, out, "reduce_scatter", op,
                                timeout=timeout)
        return self._now(self._prep_reducing(array, op, out, timeout, None, "reduce_scatter"))

    def ireduce_scatter(self, array, op="sum", *, out=None, timeout=None):
        array, out = _arrays.numpy_args(array, out, "ireduce_scatter")
        return self._post(self._prep_reducing(array, op, out, timeout, None, "reduce_scatter"),
                          "ireduce_scatter")

    def broadcast(self, array, root=0, *, out=None, timeout=None):
        if _arrays.either_foreign(array, out):
            return _arrays.call(self.broadcast, array, out, "broadcast", root, timeout=timeout)
        return self._now(self._prep_broadcast(array, root, out, timeout))

    def ibroadcast(self, array, root=0, *, out=None, timeout=None):
        array, out = _arrays.numpy_args(array, out, "ibroadcast")
        return self._post(self._prep_broadcast(array, root, out, timeout), "ibroadcast")

    def allgather(self, array, *, axis=None, out=None, timeout=None):
        if _arrays.either_foreign(array, out):
            return _arrays.call(self.allgather, array, out, "allgather", axis=axis,
                                timeout=timeout)
        return self._now(self._prep_allgather(array, axis, out, timeout))

    def iallgather(self, array, *, axis=None, out=None, timeout=None):
        array, out = _arrays.numpy_args(array, out, "iallgather")
        return self._post(self._prep_allgather(array, axis, out, timeout), "iallgather")

    def barrier(self, timeout=None):
        return self._now(self._prep_barrier(timeout))

    def ibarrier(self, timeout=None):
        return self._post(self._prep_barrier(timeout), "ibarrier")

    def empty(self, shape, dtype=float, order="C"):
        """Shared within this node (a collective of the node's members): see Communicator.
        Its errors name global ranks."""
        return self._in_node(self.local.empty, shape, dtype, order)

    def zeros(self, shape, dtype=float, order="C"):
        return self._in_node(self.local.zeros, shape, dtype, order)

    def _in_node(self, fn, *args):
        try:
            return fn(*args)
        except ShmtreeError as exc:
            if exc.args and isinstance(exc.args[0], str):
                exc.args = (self._global(exc.args[0]) + f" (in node {self.node})",) + \
                    exc.args[1:]
            raise

    def stats(self) -> dict:
        return self.local.stats()

    def close(self):
        """Leave: the node's communicator closes, the leader's link thread stops, and the node's
        group is closed by the process that created it.  (Local, like Communicator.close.)"""
        if self._closed:
            return
        self._closed = True
        try:
            self.local.close()
        finally:
            for link in {self._link, self._lane} - {None}:
                link.close()
            self.group.close()
            if _communicator._current is self:
                _communicator._set_current(None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __reduce__(self):
        raise TypeError("shmtree: a communicator cannot be sent to another process")

    # ---- running a call: every call is one prepared function on the node's executor ----

    def _now(self, run):
        self._check_open()
        return self.local._now(self._guarded(run))

    def _post(self, run, name):
        self._check_open()
        return self.local._post(self._guarded(run), name)

    def _check_open(self):
        if self._closed:
            raise ShmtreeError("shmtree: this communicator is closed")
        for link in (self._link, self._lane):
            if link is not None and link.failure is not None:
                raise PeerLostError(f"shmtree: rank {self.rank}: {link.failure}")

    def _node_failed(self):
        """A from_mpi link's interrupt: this node's group is aborted (in global ranks)."""
        group = self.group
        if not group.closed and group.aborted():
            return f"node {self.node}: {self._global(group.describe_abort(), self._in_call)}"
        return None

    def _global(self, text, call=None):
        """A message of the node's own group in the words of the whole communicator: global
        ranks, and the user's call instead of the node's internal step."""
        return global_ranks(text, self._members[self.node],
                            (lambda part: _STEP.sub(call, part)) if call else None)

    def _guarded(self, run):
        """A failure inside a call (other than a mismatch, which every rank raises alike and
        which leaves the group usable) fails every node: the node's group is aborted and the
        leader tells the other leaders.  Its message names global ranks and the user's call."""
        self._calls += 1
        call = f"{getattr(run, 'call', 'collective')} #{self._calls} across nodes"

        def guarded():
            self._in_call = call
            try:
                return run()
            except CollectiveMismatchError:
                raise
            except BaseException as exc:
                if isinstance(exc, ShmtreeError) and exc.args and isinstance(exc.args[0], str) \
                        and not _FROM_LINK.match(exc.args[0]):
                    exc.args = (self._global(exc.args[0], call),) + exc.args[1:]
                text = (f"node {self.node} (rank {self.rank}) failed in {call}: "
                        f"{type(exc).__name__}: {exc}")
                for link in {self._link, self._lane} - {None}:
                    link.abort(text)
                if not self.group.closed and not self.group.aborted():
                    self.group.abort(ABORT_FAILED, self.node_rank, note=text)
                raise
        return guarded

    # ---- the steps inside a node ----

    def _remaining(self, deadline):
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def _intra_reduce(self, seg, op, out, deadline):
        """seg (every member's) reduced into out on the leader (None elsewhere)."""
        return self.local._prep_reducing(seg, op, out, self._remaining(deadline), _REDUCE0,
                                         root=0)()

    def _intra_bcast(self, src, out, deadline, root=0):
        return self.local._prep_broadcast(src, root, out, self._remaining(deadline))()

    # ---- agreement ----

    def _agree(self, row, deadline):
        """Every rank's row, in global rank order (a (size, ROW) int64 table), the same on every
        rank: gathered in the node, exchanged between the leaders, broadcast back."""
        P, link = self.size, self._link
        mine = np.asarray(row, np.int64)
        if self.node_size > 1:
            table = self.local._prep_allgather(mine, None, None,
                                               self._remaining(deadline))()
        else:
            table = mine[None, :]
        full = table if self.nodes == 1 else None
        if link is not None:
            counts = [len(m) * ROW * 8 for m in self._members]
            full = np.empty((P, ROW), np.int64)
            link.run(Link.allgatherv, table.reshape(-1).view(np.uint8),
                     full.reshape(-1).view(np.uint8), counts, deadline=deadline)
        if self.node_size > 1:
            full = self._intra_bcast(full, None, deadline)
        if not self._in_order:
            by_rank = np.empty_like(full)
            by_rank[self._order] = full
            full = by_rank
        return full

    def _check(self, table, compare=tuple):
        """Raise CollectiveMismatchError (the same text on every rank) unless every row agrees
        with `compare`'s notion of the same call (by default: equal rows)."""
        seen = {}
        for g in range(self.size):
            seen.setdefault(compare(table[g]), []).append(g)
        if len(seen) > 1:
            def text(rs):
                nodes = ",".join(str(n) for n in sorted({self._where[r][0] for r in rs}))
                row = next((table[g] for g in rs if table[g][5] != -1), table[rs[0]])
                return f"{ranks_text(rs)} (node {nodes}): {_describe(row)}"
            parts = "; ".join(text(rs) for rs in seen.values())
            raise CollectiveMismatchError(
                f"shmtree: ranks disagree on the collective call across nodes: {parts}")

    # ---- allreduce, reduce, reduce_scatter ----

    def _prep_reducing(self, array, op, out, timeout, root, what):
        a = _movable(array, what)
        opc, _ = reduction_codes(op, a.dtype)
        if what == "reduce_scatter":
            if a.ndim == 0:
                raise ValueError("shmtree: reduce_scatter needs an array of at least 1 "
                                 "dimension")
            lo, hi, _ = _scatter_block(a, out, self.size, self.rank)
        elif out is not None:
            _out_for(out, a.shape, a.dtype, what)          # (checks out now)
        deadline = _deadline(timeout)
        kind = {"allreduce": KIND_ALLREDUCE, "reduce": KIND_REDUCE,
                "reduce_scatter": KIND_REDUCE_SCATTER}[what]
        row = _row(kind, -1 if root is None else root, opc, a)

        def run():
            table = self._agree(row, deadline)
            self._check(table)
            src = np.ascontiguousarray(a).reshape(-1)
            deliver = root is None or self._where[root][0] == self.node
            fold = self._reduce_lanes if self._lane is not None and \
                src.nbytes >= LANES_BYTES else self._reduce_pipeline
            if what == "reduce_scatter":
                full = np.empty(a.shape, a.dtype)
                fold(src, full.reshape(-1), op, True, deadline)
                block = full[lo:hi]
                if out is None:
                    return block
                out[...] = block
                return out
            if root is not None and self.rank != root:
                fold(src, None, op, deliver, deadline)
                return None
            result, copy_back = _out_for(out, a.shape, a.dtype, what)
            flat = result.reshape(-1)
            if _communicator._overlaps(src, flat):
                src = src.copy()          # out overlaps the input without being it
            fold(src, flat, op, deliver, deadline)
            return _finish(result, copy_back)
        run.call = what + (f"(root={root})" if root is not None else "")
        return run

    def _scratch_for(self, dtype, count):
        """Two segments' room on the leader, reused call after call."""
        need = 2 * count * dtype.itemsize
        if self._scratch is None or self._scratch.size < need:
            self._scratch = np.empty(max(need, 1), np.uint8)
        return [self._scratch[k * count * dtype.itemsize:(k + 1) * count * dtype.itemsize]
                .view(dtype) for k in range(2)]

    def _reduce_lanes(self, src, dst, op, deliver, deadline):
        """The multi-leader form of _reduce_pipeline (nodes of one size k): per segment, a
        reduce-scatter in the node leaves local rank r with slice r of the node's sum; the
        ranks of local rank r on every node fold their slices between them (node order, this
        rank's lane Link, on its thread); an allgather in the node puts the slices together.
        Every rank carries 1/k of the traffic between nodes and of the work in its node."""
        n, k, me, link = src.size, self.node_size, self.node_rank, self._lane
        # a step of the pipeline is two segments here (each lane carries 2/k of it): with
        # steps of one, the three calls and the handoff per step cost more than the overlap
        # gave (16 MiB float64 at k = 2, 2 nodes, 2 cores: 1.2x MPI's time against 1.0x)
        per = max(k, 2 * self._segment // max(1, src.itemsize))
        bounds = list(range(0, n, per)) + [n] if n else [0, 0]
        count = len(bounds) - 1
        room = -(-min(per, n) // k) if n else 0
        # an output of its own (not the input itself, whose segment the reduce-scatter reads
        # whole): this rank's slice is reduced into its place in the output, the lane works
        # there, and the allgather is in place (no copy of the slice through a scratch slot)
        direct = dst is not None and deliver and n and not (
            src.__array_interface__["data"][0] == dst.__array_interface__["data"][0])
        slots = None if direct else self._scratch_for(src.dtype, room)
        jobs = [None] * count
        sink = None if dst is not None else np.empty(min(per, n), src.dtype)

        def mine(j):
            lo, hi = bounds[j], bounds[j + 1]
            cut = _pieces(hi - lo, k)
            if direct:
                return dst[lo + cut[me]:lo + cut[me + 1]]
            return slots[j % 2][:cut[me + 1] - cut[me]]

        def finish(j):
            lo, hi = bounds[j], bounds[j + 1]
            _wait(link, jobs[j], deadline)
            if deliver:
                target = dst[lo:hi] if dst is not None else sink[:hi - lo]
                self.local._prep_allgather(mine(j), 0, target, self._remaining(deadline))()

        for i in range(count):
            lo, hi = bounds[i], bounds[i + 1]
            part = mine(i)
            self.local._prep_reduce_scatter(src[lo:hi], op, part, self._remaining(deadline))()
            if count == 1:
                link.run(Link.allreduce, part, op, deadline=deadline)
            else:
                jobs[i] = link.submit(Link.allreduce, part, op)
            if i >= 1:
                finish(i - 1)
        finish(count - 1)

    def _reduce_pipeline(self, src, dst, op, deliver, deadline):
        """dst[:] = the reduction of every rank's src (1-d contiguous, the same size), segment
        by segment: reduce to the leader; between the leaders; broadcast in the node (when
        `deliver`; dst None: this rank wants nothing).  The leader reduces segment i while its
        link thread carries segment i-1."""
        if self._lane is not None and src.size:     # (nodes of one size: every rank works)
            return self._reduce_small_lanes(src, dst, op, deadline)
        n = src.size
        per = max(1, self._segment // max(1, src.itemsize))
        bounds = list(range(0, n, per)) + [n] if n else [0, 0]
        count = len(bounds) - 1
        link, leader = self._link, self.node_rank == 0
        multi = self.node_size > 1
        # the leader with an output of its own (and a from_mpi link, not a proxy, whose steps
        # need its mailbox's slots): its node's sum is folded straight into the output and the
        # link works there in place, instead of in a scratch slot copied out at the end (a
        # node of one rank: the link reads the input and writes the output, no copy at all)
        direct = leader and dst is not None and not hasattr(link, "scratch")
        # (src and dst are the same memory or do not overlap: _prep_reducing copies an input
        # that out overlaps otherwise)
        inplace = direct and (src.__array_interface__["data"][0] ==
                              dst.__array_interface__["data"][0])
        slots = None
        if leader and not direct:
            room = per if count > 1 else n
            slots = link.scratch(src.dtype, room) if hasattr(link, "scratch") else \
                self._scratch_for(src.dtype, room)
        jobs = [None] * count
        sink = None if dst is not None else (np.empty(min(per, n), src.dtype) if deliver
                                             else None)

        def held(j):                 # the leader's buffer of segment j
            lo, hi = bounds[j], bounds[j + 1]
            return dst[lo:hi] if direct else slots[j % 2][:hi - lo]

        def finish(j):
            lo, hi = bounds[j], bounds[j + 1]
            if leader:
                buf = held(j)
                if jobs[j] is not None:
                    link.wait(jobs[j], deadline)
                if deliver:
                    target = dst[lo:hi] if dst is not None else sink[:hi - lo]
                    if multi:
                        self._intra_bcast(buf, target, deadline)
                    elif not direct:
                        target[...] = buf
            elif deliver:
                target = dst[lo:hi] if dst is not None else sink[:hi - lo]
                self._intra_bcast(None, target, deadline)

        for i in range(count):
            lo, hi = bounds[i], bounds[i + 1]
            seg = src[lo:hi]
            if leader:
                buf = held(i)
                extra = ()
                if multi:
                    self._intra_reduce(seg, op, buf, deadline)
                elif direct and not inplace and src.flags.aligned:
                    extra = (seg,)            # (Link.allreduce's src: read there)
                elif not inplace:
                    buf[...] = seg
                if link is not None and count == 1:     # (no pipeline: no thread handoff)
                    link.run(Link.allreduce, buf, op, *extra, deadline=deadline)
                elif link is not None:
                    jobs[i] = link.submit(Link.allreduce, buf, op, *extra)
            else:
                self._intra_reduce(seg, op, None, deadline)
            if i >= 1:
                finish(i - 1)
        finish(count - 1)

    def _reduce_small_lanes(self, src, dst, op, deadline):
        """A message below LANES_BYTES with nodes of one size: the node's allreduce gives every
        member the node's sum (the same bits on every member), then every lane folds the
        nodes' sums in node order (Link.allreduce: the same steps and bits on every lane).  Two
        steps in each of which every rank works, instead of three (reduce to the leader, the
        leaders, broadcast) in two of which the non-leaders wait."""
        target = dst if dst is not None else np.empty(src.size, src.dtype)
        self.local._prep_reducing(src, op, target, self._remaining(deadline),
                                  KIND_ALLREDUCE)()
        # (watch=False: a node peer may have its result already and close the group while
        # this lane still folds; nothing of this step depends on the node any more)
        self._lane.run(Link.allreduce, target, op, deadline=deadline, watch=False)

    # ---- broadcast ----

    def _prep_broadcast(self, array, root, out, timeout):
        root = _root(root, self.size)
        deadline = _deadline(timeout)
        if array is None:
            if self.rank == root:
                raise ValueError("shmtree: broadcast: the root must pass the array")
            a = None
        else:
            a = _movable(array, "broadcast")
        row = _row(KIND_BROADCAST, root, 0, a) if a is not None else \
            [KIND_BROADCAST, root, 0, 0, 0, -1, 0, 0, 0, 0]

        def run():
            table = self._agree(row, deadline)
            rootrow = tuple(table[root])

            def key(r):          # non-roots that passed None agree with any shape and dtype
                t = tuple(r)
                return rootrow if t[:2] == rootrow[:2] and (r[5] == -1 or t == rootrow) else t
            self._check(table, key)
            rnode, rlocal = self._where[root]
            src = np.ascontiguousarray(a) if self.rank == root else None
            if any(r[5] == -1 for r in table):      # someone passed None: describe the array
                dtype, shape = self._meta(src, rnode, rlocal, deadline)
            else:
                dtype, shape = a.dtype, a.shape
            result, copy_back = _out_for(out, shape, dtype, "broadcast")
            view = result.reshape(-1).view(np.uint8) if result.size else \
                np.empty(0, np.uint8)
            if self.rank == root and result.size:
                raw = src.reshape(-1).view(np.uint8)
                # the same bytes: nothing to move; any other overlap: numpy's assignment
                # copies through a temporary (the root's data, not a half-moved mix)
                if not (raw.__array_interface__["data"][0] ==
                        view.__array_interface__["data"][0] and raw.size == view.size):
                    view[...] = raw
            self._bcast_pipeline(view, rnode, rlocal, deadline)
            return _finish(result, copy_back)
        run.call = f"broadcast(root={root})"
        return run

    def _meta(self, a, rnode, rlocal, deadline):
        """(dtype, shape) of the root's array, for ranks that passed None: a small broadcast
        of its pickled description through the same steps as the data."""
        import pickle
        blob = np.zeros(1024, np.uint8)
        if a is not None:
            raw = pickle.dumps((a.dtype, a.shape), protocol=4)
            if len(raw) > blob.size - 4:
                raise ValueError("shmtree: broadcast: the root's dtype is too complex to "
                                 "describe to ranks that passed None; pass arrays of its "
                                 "shape and dtype on every rank")
            blob[:4] = np.frombuffer(len(raw).to_bytes(4, "little"), np.uint8)
            blob[4:4 + len(raw)] = np.frombuffer(raw, np.uint8)
        self._bcast_pipeline(blob, rnode, rlocal, deadline)
        length = int.from_bytes(blob[:4].tobytes(), "little")
        return pickle.loads(blob[4:4 + length].tobytes())

    def _bcast_pipeline(self, view, rnode, rlocal, deadline):
        """view (bytes; the root's data at the root) on every rank: in the root's node from the
        root, between the leaders from the root node's leader, in the other nodes from their
        leader, segment by segment."""
        n = view.size
        if n == 0:
            return
        per = self._segment
        bounds = list(range(0, n, per)) + [n]
        link, leader, multi = self._link, self.node_rank == 0, self.node_size > 1
        count = len(bounds) - 1
        root_node = self.node == rnode
        jobs = {}

        def post(i):                 # (at most two steps in flight: the proxy's two slots)
            if leader and link is not None and count == 1 and i == 0:
                link.run(Link.bcast, view, rnode, deadline=deadline)    # (no handoff)
                jobs[i] = None
            elif leader and link is not None and i < count:
                jobs[i] = link.submit(Link.bcast, view[bounds[i]:bounds[i + 1]],
                                      rnode)
        if not root_node:
            post(0)
        for i in range(count):
            seg = view[bounds[i]:bounds[i + 1]]
            if root_node:
                if multi:
                    self._intra_bcast(seg if self.node_rank == rlocal else None, seg,
                                      deadline, root=rlocal)
                if i >= 1 and leader and link is not None:
                    _wait(link, jobs.pop(i - 1), deadline)
                post(i)
            else:
                post(i + 1)
                if leader:
                    _wait(link, jobs.pop(i), deadline)
                if multi:
                    self._intra_bcast(seg if leader else None, seg, deadline)
        for i in sorted(jobs):
            _wait(link, jobs.pop(i), deadline)

    # ---- allgather ----

    def _prep_allgather(self, array, axis, out, timeout):
        if axis is not None and axis != 0:
            raise ValueError(f"shmtree: allgather: axis must be None or 0, got {axis!r}")
        a = _movable(array, "allgather")
        if axis == 0 and a.ndim == 0:
            raise ValueError("shmtree: allgather(axis=0) needs arrays of at least 1 dimension")
        if axis is None:
            _out_for(out, (self.size,) + a.shape, a.dtype, "allgather")
        deadline = _deadline(timeout)
        row = _row(KIND_ALLGATHER, -1 if axis is None else 0, 0, a)

        def run():
            table = self._agree(row, deadline)
            if axis is None:
                self._check(table)
                lengths = [1] * self.size
                shape = (self.size,) + a.shape
            else:      # lengths along axis 0 may differ: compare the rest
                self._check(table, lambda r: (tuple(r[:5]), tuple(r[6:7]), tuple(r[8:])))
                lengths = [int(table[g, 7]) for g in range(self.size)]
                shape = (sum(lengths),) + a.shape[1:]
            rowbytes = a.dtype.itemsize * (int(np.prod(a.shape, dtype=np.int64)) if axis is None
                                           else int(np.prod(a.shape[1:], dtype=np.int64)))
            result, copy_back = _out_for(out, shape, a.dtype, "allgather")
            mine = np.ascontiguousarray(a)
            # this node's blocks, by local rank, on every member
            if self.node_size > 1:
                node_blocks = self.local._prep_allgather(mine, axis, None,
                                                         self._remaining(deadline))()
            else:
                node_blocks = mine if axis == 0 else mine[None]
                if np.may_share_memory(node_blocks, result):
                    node_blocks = node_blocks.copy()    # (the input overlaps out)
            sizes = [sum(lengths[g] for g in m) * rowbytes for m in self._members]
            total = sum(sizes)
            flat = result.reshape(-1).view(np.uint8) if total else np.empty(0, np.uint8)
            link = self._link
            if link is not None:
                gathered = flat if self._in_order else np.empty(total, np.uint8)
                mine_raw = np.ascontiguousarray(node_blocks).reshape(-1).view(np.uint8)
                room = getattr(link, "capacity", None)
                # (the same choice on every node: the largest node's block decides)
                if room is None or 8 * self.nodes + max(sizes) + total <= room:
                    link.run(Link.allgatherv, mine_raw, gathered, sizes,
                             deadline=deadline)
                else:                # (too big for the proxy's mailbox: node by node)
                    starts = np.concatenate([[0], np.cumsum(sizes)]).tolist()
                    gathered[starts[self.node]:starts[self.node + 1]] = mine_raw
                    for m in range(self.nodes):
                        part = gathered[starts[m]:starts[m + 1]]
                        for lo in range(0, part.size, room):
                            link.run(Link.bcast, part[lo:lo + room], m,
                                     deadline=deadline)
                if not self._in_order:
                    self._place(gathered, flat, lengths, rowbytes)
            if self.node_size > 1 and total:
                self._intra_bcast(flat if self.node_rank == 0 else None, flat, deadline)
            return _finish(result, copy_back)
        run.call = "allgather"
        return run

    def _place(self, gathered, flat, lengths, rowbytes):
        """Blocks gathered in node order, moved to global rank order."""
        starts = np.concatenate([[0], np.cumsum([n * rowbytes for n in lengths])]).tolist()
        at = 0
        for g in self._order:
            nb = lengths[g] * rowbytes
            flat[starts[g]:starts[g] + nb] = gathered[at:at + nb]
            at += nb

    # ---- barrier ----

    def _prep_barrier(self, timeout):
        deadline = _deadline(timeout)
        row = [KIND_BARRIER, -1, 0, 0, 0, 0, 0, 0, 0, 0]

        def run():
            table = self._agree(row, deadline)      # (every rank arrived: that is the barrier)
            self._check(table)
        run.call = "barrier"
        return run


def _wait(link, job, deadline):
    if job is not None:              # (None: the step ran at once, in this thread)
        link.wait(job, deadline)


def _row(kind, root, opc, a):
    """A rank's description of its call: kind, root, op, dtype digest, dtype number, byte count,
    ndim, first two dimensions, shape digest."""
    shape = a.shape
    d0 = shape[0] if len(shape) > 0 else 0
    d1 = shape[1] if len(shape) > 1 else 0
    digest = hash(shape[1:]) & 0x7fffffffffffffff if kind == KIND_ALLGATHER and root == 0 \
        else hash(shape) & 0x7fffffffffffffff
    return [kind, root, opc, _dtype_digest(a.dtype), a.dtype.num, a.nbytes, len(shape),
            d0, d1, digest]


def _dtype_text(num):
    """A dtype's name from its number (numpy's builtin types; bfloat16 when ml_dtypes is
    loaded), else its number."""
    for t in list(np.sctypeDict.values()):
        try:
            if np.dtype(t).num == num:
                return np.dtype(t).name
        except TypeError:
            pass
    import sys
    ml = sys.modules.get("ml_dtypes")
    if ml is not None and np.dtype(ml.bfloat16).num == num:
        return "bfloat16"
    return f"#{num}"


def _describe(r):
    kind, root, opc = int(r[0]), int(r[1]), int(r[2])
    name = KIND_NAMES.get(kind, "collective")
    if kind == KIND_BARRIER:
        return "barrier"
    if r[5] == -1:
        return f"{name}(root={root}, None)"
    ndim = int(r[6])
    dims = [str(int(r[7])), str(int(r[8]))][:ndim] + (["..."] if ndim > 2 else [])
    shape = "(" + ", ".join(dims) + ("," if ndim == 1 else "") + ")"
    parts = [f"root={root}"] if kind in (KIND_BROADCAST, KIND_REDUCE) else []
    parts.append(f"shape={shape}")
    parts.append(f"dtype={_dtype_text(int(r[4]))}")
    if kind in (KIND_ALLREDUCE, KIND_REDUCE, KIND_REDUCE_SCATTER):
        parts.append(f"op={OP_NAMES.get(opc, opc)!r}")
    if kind == KIND_ALLGATHER:
        parts.append("axis=None" if root == -1 else "axis=0")
    return f"{name}({', '.join(parts)})"


# ---------------------------------------------------------------------------------------------
# the launcher-per-node way in: Group(size, inter=mpi_comm) (shmtree.mailbox)


def start_proxy(group, inter, segment_bytes):
    """In a launcher creating its node's group: agree with the other launchers (collective over
    `inter`) and start the proxy.  (span, proxy) for the group; (None, None) with one node.
    Whether every launcher could start is agreed before any step of all of them: one that
    cannot (bad option, no memory for its mailbox) raises its error, the others a ShmtreeError
    naming it, none waits for it in MPI."""
    from mpi4py import MPI
    from .mailbox import Mailbox, Proxy
    segment, box, err = None, None, None
    try:
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise ShmtreeError("shmtree: inter= needs MPI initialised with "
                               "MPI_THREAD_MULTIPLE (the proxy runs MPI on a thread of its "
                               "own); leave mpi4py.rc.thread_level at its default, 'multiple'")
        segment = SEGMENT_BYTES if segment_bytes is None else int(segment_bytes)
        if segment < 4096:
            raise ValueError(f"shmtree: segment_bytes must be at least 4096, got "
                             f"{segment_bytes!r}")
        if inter.Get_size() > 1:
            box = Mailbox.create(segment)
    except Exception as exc:
        err = exc
    info = _agree_start(inter, group.size, segment, err)
    failed = [(n, e) for n, (_, _, e) in enumerate(info) if e is not None]
    if failed and box is not None:
        os.close(box[1])
    if err is not None:
        raise err
    if failed:
        raise ShmtreeError("shmtree: the launcher" + ("s" if len(failed) > 1 else "") +
                           " of " + "; ".join(f"node {n} could not start its group: {e}"
                                              for n, e in failed))
    if len({g for _, g, _ in info}) > 1:
        raise ValueError(f"shmtree: the launchers passed different segment_bytes: "
                         f"{[g for _, g, _ in info]}")
    if len(info) == 1:
        return None, None
    proxy = Proxy(group, inter, segment, box)
    return (inter.Get_rank(), [s for s, _, _ in info], segment, proxy.fd), proxy


def _agree_start(inter, size, segment, err):
    """The launchers' one agreement before any step (collective over `inter`): by node, its
    group size, segment bytes and its error's text (None: it could start)."""
    return inter.allgather((size, segment,
                            None if err is None else f"{type(err).__name__}: {err}"))


def refuse_proxy(inter, err):
    """In a launcher whose group could not even be made (a bad option, no memory): take part in
    start_proxy's agreement with its error, so that the other launchers raise naming this node
    instead of waiting for it in MPI."""
    _agree_start(inter, 0, 0, err)


def spanning_member(group, comm):
    """Group.join in a worker of a node of several: the communicator across nodes around the
    node's own (`comm`); local rank 0 reaches the other nodes through its launcher."""
    from .mailbox import Mailbox, ProxyLink
    node, sizes, segment, box_fd = group._span
    starts = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    members = [list(range(starts[n], starts[n + 1])) for n in range(len(sizes))]
    link = ProxyLink(Mailbox(box_fd, segment)) if comm.rank == 0 else None
    return Spanning(comm, link, starts[node] + comm.rank, members, node, segment)


# ---------------------------------------------------------------------------------------------
# forming the communicator from an MPI job


def from_mpi(mpi_comm, *, node_size=None, segment_bytes=None, **group_options):
    """A communicator spanning the processes of `mpi_comm` (mpi4py), one shmtree group per node.

    Collective over mpi_comm.  Processes that share a node (MPI's COMM_TYPE_SHARED split; with
    `node_size=k`, consecutive blocks of k ranks instead, to simulate nodes on one machine)
    form a group through a rendezvous: the node's first process creates the segment, the others
    attach (same user only).  comm.rank == mpi_comm.rank.  group_options are Group's (pin
    defaults to False here: the MPI launcher places the processes)."""
    from mpi4py import MPI
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise ShmtreeError("shmtree.from_mpi: MPI was initialised without MPI_THREAD_MULTIPLE "
                           "(the inter-node step runs on a thread of its own); leave "
                           "mpi4py.rc.thread_level at its default, 'multiple'")
    rank = mpi_comm.Get_rank()
    if node_size is None:
        node_comm = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    else:
        if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1:
            raise ValueError(f"shmtree.from_mpi: node_size must be a positive int, got "
                             f"{node_size!r}")
        node_comm = mpi_comm.Split(rank // node_size, key=rank)
    try:
        node_rank, nsize = node_comm.Get_rank(), node_comm.Get_size()
        first = node_comm.allreduce(rank, op=MPI.MIN)
        everyone = mpi_comm.allgather((first, node_rank))
        firsts = sorted({f for f, _ in everyone})
        members = [[] for _ in firsts]
        for g, (f, r) in enumerate(everyone):
            members[firsts.index(f)].append((r, g))
        members = [[g for _, g in sorted(m)] for m in members]
        node = firsts.index(first)
        options = dict(group_options)
        options.setdefault("pin", False)
        token, err, group, local = None, None, None, None
        if node_rank == 0:
            try:
                group = Group(nsize, **options)
                token = group.rendezvous_token()
            except Exception as exc:
                err = f"rank {rank}: {type(exc).__name__}: {exc}"
        token, err = node_comm.bcast((token, err), root=0)
        if err is None:
            try:
                if node_rank != 0:
                    group = Group.from_token(token)
                local = group.join(node_rank)
            except Exception as exc:
                err = f"rank {rank}: {type(exc).__name__}: {exc}"
        # success is agreed over the whole communicator before any step of all of it: a node
        # that could not form its group makes every rank of every node raise, none waits
        every = mpi_comm.allgather(err)
        failed = sorted({g for g, e in enumerate(every) if e is not None})
        if failed:
            if local is not None:
                local.close()
            if group is not None:
                group.close()
            bad = sorted({firsts.index(everyone[g][0]) for g in failed})
            texts = "; ".join(dict.fromkeys(e for e in every if e is not None))
            raise ShmtreeError(
                f"shmtree.from_mpi: the processes of node{'s' if len(bad) > 1 else ''} "
                f"{','.join(map(str, bad))} could not form a group: {texts}")
        node_comm.Barrier()            # every member attached before the creator goes on
    finally:
        node_comm.Free()
    link = lane = None
    if len({len(m) for m in members}) == 1 and len(members) > 1 and nsize > 1:
        # nodes of one size: every rank links to its local rank's peers on the other nodes
        # (a lane); lane 0 joins the leaders
        lane = Link(mpi_comm.Split(node_rank, key=node), group)
        link = lane if node_rank == 0 else None
    else:
        leaders = mpi_comm.Split(0 if node_rank == 0 else MPI.UNDEFINED, key=node)
        if node_rank == 0 and len(members) > 1:
            link = Link(leaders, group)
        elif leaders != MPI.COMM_NULL:
            leaders.Free()
    comm = Spanning(local, link, rank, members, node,
                    SEGMENT_BYTES if segment_bytes is None else segment_bytes, lane=lane)
    _communicator._set_current(comm)
    return comm


@atexit.register
def _close_all():
    """Before mpi4py finalizes MPI (its atexit hook was registered before this one): stop every
    link thread."""
    for comm in list(_ALIVE):
        try:
            comm.close()
        except Exception:
            pass

