"""The data steps of a call across nodes (Spanning's, nodes.py): the pipelines that cut a
message into segments and overlap a node's own step (a parsed call run on the node's
communicator: Communicator.run) with the step between the nodes (on a Link's thread,
shmtree.inter), and the steps inside a node they are made of.

  * _reduce_pipeline: reduce to the leader in the node, the leaders' allreduce, broadcast in
    the node; the leader's main thread works on segment i+1 while its link carries segment i;
  * _reduce_lanes (from_mpi, nodes of one size, from LANES_BYTES): a reduce-scatter in the
    node leaves local rank r with slice r of the node's sum, the ranks of local rank r on every
    node fold their slices on their lane, an allgather in the node puts them together;
  * _reduce_small_lanes (below LANES_BYTES): the node's allreduce, then every lane folds the
    nodes' sums whole;
  * _bcast_pipeline: in the root's node from the root, between the leaders from the root
    node's leader, in the other nodes from their leader, segment by segment.
"""
from __future__ import annotations

import time

import numpy as np

from . import calls
from .calls import split_bounds as _pieces
from .inter import Link

__all__ = ["Pipelines"]


class Pipelines:
    """Spanning's data steps (a mixin: local, node_rank, node_size, _link, _lane, _segment,
    _scratch are Spanning's)."""

    def _remaining(self, deadline):
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def _intra_reduce(self, seg, op, out, deadline):
        """seg (every member's) reduced into out on the leader (None elsewhere)."""
        return self.local.run(calls.reduce(self.local, seg, op, 0, out,
                                           self._remaining(deadline)))

    def _intra_bcast(self, src, out, deadline, root=0):
        return self.local.run(calls.broadcast(self.local, src, root, out,
                                              self._remaining(deadline)))

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
                self.local.run(calls.allgather(self.local, mine(j), 0, target,
                                               self._remaining(deadline)))

        for i in range(count):
            lo, hi = bounds[i], bounds[i + 1]
            part = mine(i)
            self.local.run(calls.reduce_scatter(self.local, src[lo:hi], op, part,
                                                self._remaining(deadline)))
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
        # (src and dst are the same memory or do not overlap: Spanning._exec_reducing copies
        # an input that out overlaps otherwise)
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
        self.local.run(calls.allreduce(self.local, src, op, target,
                                       self._remaining(deadline)))
        # (watch=False: a node peer may have its result already and close the group while
        # this lane still folds; nothing of this step depends on the node any more)
        self._lane.run(Link.allreduce, target, op, deadline=deadline, watch=False)

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


def _wait(link, job, deadline):
    if job is not None:              # (None: the step ran at once, in this thread)
        link.wait(job, deadline)
