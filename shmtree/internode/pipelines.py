"""The data steps of a call across nodes (Spanning's, nodes.py): the pipelines that cut a
message into segments and overlap a node's own step (a parsed call run on the node's
communicator: Communicator.run) with the step between the nodes (on a Link's thread,
shmtree.internode.inter), and the steps inside a node they are made of.

  * _reduce_pipeline: reduce to the leader in the node, the leaders' allreduce, broadcast in
    the node; the leader's main thread works on segment i+1 while its link carries segment i;
  * _reduce_lanes (from_mpi, nodes of one size, from LANES_BYTES): a reduce-scatter in the
    node leaves local rank r with slice r of the node's sum, the ranks of local rank r on every
    node fold their slices on their lane, an allgather in the node puts them together;
  * _reduce_small_lanes (below LANES_BYTES): the node's allreduce, then every lane folds the
    nodes' sums whole;
  * _bcast_pipeline: in the root's node from the root, between the leaders from the root
    node's leader, in the other nodes from their leader, segment by segment;
  * _exchange_nodes: blocks of any sizes between any pairs of ranks (alltoall, gather,
    scatter, scan): in the node to the leader (what leaves the node) and to the node's peers
    (what stays), between the leaders node to node, from the leader to the node's members.
"""
from __future__ import annotations

import time

import numpy as np

from ..frontend import calls
from ..frontend.calls import split_bounds as _pieces
from .inter import Link

__all__ = ["Pipelines"]


LEADER_GRACE_S = 0.5         # (Pipelines._remaining)


class Pipelines:
    """Spanning's data steps (a mixin: local, node_rank, node_size, _link, _lane, _segment,
    _scratch are Spanning's)."""

    def _remaining(self, deadline):
        """The time left of a call's deadline, for one in-node step.  A member other than the
        leader, on a communicator of several nodes, waits LEADER_GRACE_S longer: when its
        node's leader is late in a step it waits in across nodes, the leader's verdict (which
        ranks, of which nodes, had not arrived) comes first and is what every rank says,
        instead of a member's own "the leader had not arrived"."""
        if deadline is None:
            return None
        if self.node_rank and self.nodes > 1:
            deadline += LEADER_GRACE_S
        return max(0.0, deadline - time.monotonic())

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

    def _leaders_allgatherv(self, mine, gathered, sizes, deadline):
        """Every node's `mine` (bytes; node m's has sizes[m]) into `gathered`, in node order,
        between the leaders: one allgatherv, or (too big for a launcher's mailbox) node by node
        as broadcasts of at most a slot each (the same choice on every node: the largest
        node's block decides)."""
        link = self._link
        room = getattr(link, "capacity", None)
        total = sum(sizes)
        if room is None or 8 * self.nodes + max(sizes) + total <= room:
            link.run(Link.allgatherv, mine, gathered, sizes, deadline=deadline)
            return
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64).tolist()
        gathered[starts[self.node]:starts[self.node + 1]] = mine
        for m in range(self.nodes):
            part = gathered[starts[m]:starts[m + 1]]
            for lo in range(0, part.size, room):
                link.run(Link.bcast, part[lo:lo + room], m, deadline=deadline)

    def _exchange_nodes(self, src, dst, B, deadline):
        """One exchange across nodes: B[p, q] bytes from global rank p to global rank q (a
        (size, size) int64 matrix, the same on every rank); src: this rank's outgoing bytes
        back to back in destination (global rank) order, dst: its incoming bytes back to back
        in source order (both contiguous uint8, not sharing memory).

          1. in the node (an alltoall with counts of the node's communicator): each member sends
             to each peer what is that peer's, and to the leader, besides its own, everything
             that leaves the node (its blocks for the other nodes' ranks, in global order);
          2. between the leaders (Link.exchange, point to point, nothing posted for a pair with
             nothing to move): to node m, for each member of this node in local order, its
             blocks for node m's ranks in global order; a launcher's mailbox takes the step in
             rounds of at most a slot;
          3. in the node: the leader sends each member what came for it from the other nodes
             (in global order of the sources).
        Each member then puts its blocks in source order.  A step in which no rank of the node
        moves a byte to another is skipped (every rank knows B: the same choice everywhere).
        With lanes (from_mpi, nodes of one size): _exchange_lanes."""
        if self._lane is not None:
            return self._exchange_lanes(src, dst, B, deadline)
        P, node, members = self.size, self.node, self._members
        mine = members[node]
        k, j, me = len(mine), self.node_rank, self.rank
        inside = np.zeros(P, bool)
        inside[mine] = True
        outside = np.flatnonzero(~inside)               # the other nodes' ranks, ascending
        at_out = np.full(P, -1, np.int64)
        at_out[outside] = np.arange(outside.size)
        out_rows = B[:, outside]                          # (P, |outside|)
        off = _offsets(B[me])                             # my outgoing blocks, by destination
        into = _offsets(B[:, me])                         # my incoming blocks, by source
        leaving = out_rows[mine].sum(axis=1)              # what each member sends off the node
        # step 1: counts[x, d] bytes from local x to local d
        C1 = B[np.ix_(mine, mine)].copy()
        C1[:, 0] += leaving
        moved1 = (C1 - np.diag(np.diag(C1))).any()
        if moved1:
            parts = [src[off[mine[0]]:off[mine[0] + 1]]] + \
                [src[off[g]:off[g + 1]] for g in outside] + \
                [src[off[g]:off[g + 1]] for g in mine[1:]]
            send = _joined(parts, int(C1[j].sum()))
            got1 = self.local.run(calls.alltoall(self.local, send, tuple(C1[j].tolist()), None,
                                                 self._remaining(deadline)))
        else:                        # (only what each member keeps: its own block, at most)
            got1 = src[off[me]:off[me + 1]]
            if j == 0:
                got1 = _joined([got1] + [src[off[g]:off[g + 1]] for g in outside],
                               int(C1[0, 0]))
        from1 = _offsets(C1[:, j])                        # got1 by local source
        # step 2 (the leader): node to node
        link = self._link
        C3 = B[np.ix_(outside, mine)].sum(axis=0)         # bytes from off the node, by member
        got3 = None
        if j == 0:
            got3 = self._leaders_exchange(got1, from1, C1, B, mine, outside, at_out,
                                          deadline) if link is not None else None
        # step 3: from the leader to the members
        if k > 1 and C3[1:].any():
            if j == 0:
                send3 = got3 if got3 is not None else np.empty(0, np.uint8)
                counts = tuple(C3.tolist())
                got3 = self.local.run(calls.alltoall(self.local, send3, counts, None,
                                                     self._remaining(deadline)))
                # (the leader keeps its own part: the first C3[0] bytes)
            else:
                got3 = self.local.run(calls.alltoall(self.local, np.empty(0, np.uint8),
                                                     (0,) * k, None,
                                                     self._remaining(deadline)))
        elif j == 0 and got3 is not None:
            got3 = got3[:int(C3[0])]
        # the blocks in source order
        from3 = _offsets(B[outside, me])
        for s in range(P):
            n = int(B[s, me])
            if not n:
                continue
            if inside[s]:
                x = mine.index(s)
                piece = got1[from1[x]:from1[x] + n]
            else:
                a = at_out[s]
                piece = got3[from3[a]:from3[a] + n]
            dst[into[s]:into[s] + n] = piece

    def _exchange_lanes(self, src, dst, B, deadline):
        """_exchange_nodes on the lanes (nodes of one size k): every rank carries 1/k of its
        node's traffic between the nodes, and nothing passes through a leader.
          1. in the node (an alltoall with counts): each member sends local rank q its blocks
             for the ranks of local rank q on every node (in node order);
          2. on the lanes (Link.exchange): local rank q sends lane peer m, for each member of
             its node in local order, that member's block for node m's rank of local rank q.
        Each rank then holds every block for itself, and puts them in source order."""
        N, k = self.nodes, self.node_size
        members, node, r, me = self._members, self.node, self.node_rank, self.rank
        mine = members[node]
        off, into = _offsets(B[me]), _offsets(B[:, me])
        lanes = [[members[m][q] for m in range(N)] for q in range(k)]   # lane q's ranks
        C1 = np.array([[int(B[g, lanes[q]].sum()) for q in range(k)] for g in mine], np.int64)
        send = _joined([src[off[g]:off[g + 1]] for q in range(k) for g in lanes[q]],
                       int(C1[r].sum()))
        if (C1 - np.diag(np.diag(C1))).any():
            got1 = self.local.run(calls.alltoall(self.local, send, tuple(C1[r].tolist()), None,
                                                 self._remaining(deadline)))
        else:
            got1 = send
        from1 = _offsets(C1[:, r])
        at = [[from1[x] + o for o in _offsets(B[g, lanes[r]])] for x, g in enumerate(mine)]
        sends, recvs = [], []
        for m in range(N):
            sends.append(_joined([got1[at[x][m]:at[x][m + 1]] for x in range(k)],
                                 int(B[mine, lanes[r][m]].sum())))
            recvs.append(np.empty(int(B[members[m], me].sum()), np.uint8))
        self._lane.run(Link.exchange, sends, recvs, deadline=deadline)
        for m in range(N):
            at_m = 0
            for s in members[m]:
                n = int(B[s, me])
                dst[into[s]:into[s] + n] = recvs[m][at_m:at_m + n]
                at_m += n

    def _leaders_exchange(self, got1, from1, C1, B, mine, outside, at_out, deadline):
        """Step 2 of _exchange_nodes, on the leader: got1 holds, for each member x (local
        order), its block for the leader then its blocks for `outside` (ascending).  Returns
        what came for this node's members from the other nodes: for each member d (local
        order), its blocks from `outside` in ascending order."""
        members, node, N = self._members, self.node, self.nodes
        k = len(mine)
        # each member's blocks for the other nodes' ranks, within got1
        starts = [[from1[x] + int(B[g, mine[0]]) + o for o in _offsets(B[g, outside])]
                  for x, g in enumerate(mine)]
        sends, recvs = [], []
        for m in range(N):
            if m == node:
                sends.append(np.empty(0, np.uint8))
                recvs.append(np.empty(0, np.uint8))
                continue
            dests = sorted(members[m])
            parts = [got1[starts[x][at_out[d]]:starts[x][at_out[d] + 1]]
                     for x in range(k) for d in dests]
            sends.append(_joined(parts, int(B[np.ix_(mine, dests)].sum())))
            recvs.append(np.empty(int(B[np.ix_(members[m], sorted(mine))].sum()), np.uint8))
        room = getattr(self._link, "capacity", None)
        if room is None:
            self._link.run(Link.exchange, sends, recvs, deadline=deadline)
        else:                        # (a launcher's mailbox: rounds of at most a slot)
            q = max(1, (room - 16 * N) // (2 * N))
            sizes = [int(B[np.ix_(members[a], members[b])].sum()) for a in range(N)
                     for b in range(N) if a != b]
            for t in range(-(-max(sizes + [0]) // q)):
                self._link.run(Link.exchange, [p[t * q:(t + 1) * q] for p in sends],
                               [p[t * q:(t + 1) * q] for p in recvs], deadline=deadline)
        # what came, by member: from each other node m, for s in m's local order, for d in
        # this node's ranks ascending; wanted: for d in local order, s ascending
        order = sorted(mine)
        where = {}
        for m in range(N):
            if m == node:
                continue
            at = 0
            for s in members[m]:
                for d in order:
                    n = int(B[s, d])
                    where[s, d] = (m, at, n)
                    at += n
        parts = []
        for d in mine:
            for s in outside:
                m, at, n = where[s, d]
                if n:
                    parts.append(recvs[m][at:at + n])
        return _joined(parts, sum(p.size for p in parts))


def _offsets(row):
    """[0, cumulative sums of row] as a list of ints (the starts of blocks back to back)."""
    return [0] + np.cumsum(np.asarray(row, np.int64)).tolist()


def _joined(parts, total):
    """The byte arrays `parts` back to back in one contiguous uint8 array."""
    out = np.empty(total, np.uint8)
    at = 0
    for p in parts:
        out[at:at + p.size] = p
        at += p.size
    return out


def _wait(link, job, deadline):
    if job is not None:              # (None: the step ran at once, in this thread)
        link.wait(job, deadline)
