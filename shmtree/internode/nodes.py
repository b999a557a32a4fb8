"""Collectives across nodes: a node's shared-memory group plus MPI between the nodes' leaders.

Spanning (docs/design.md, "Across nodes (MPI)") spans every node: the processes that share a
node form a shmtree group of their own, whose local rank 0 is the node's leader and owns the
inter-node Link (shmtree.internode.inter).  rank and size are global; node, nodes: this node's index
(nodes ordered by their smallest global rank) and their count; node_rank, node_size.  It is a
Front (front.py): its calls are parsed by calls.py, and each CallSpec runs on an executor here
(_exec_*), as one function on the node's communicator's executor.
shmtree.internode.multinode forms it (from_mpi; a launcher per node, Group(..., inter=)).

Every collective is hierarchical (docs/algorithms.md, "Across nodes"):
  1. agreement: every rank's description of the call (kind, root, op, dtype, shape) is gathered
     in the node, exchanged between the leaders and broadcast back, so that a mismatch anywhere
     raises CollectiveMismatchError on every rank of every node, naming global ranks, before
     any data moves (the group stays usable);
  2. the data, segment by segment (SEGMENT_BYTES): reduce to the leader in the node, the
     inter-node step on the leader's link thread, broadcast in the node; the leader's main
     thread works on segment i+1 in the node while its link thread carries segment i between
     the nodes, so a large message costs about the larger of the two steps, not their sum.
     alltoall, gather, scatter, scan and exscan are exchanges across nodes instead
     (pipelines._exchange_nodes: in the node, between the leaders or on the lanes, in the
     node; not cut into segments).

The reduction order is fixed by this plan (the node's own tree order, then nodes in order), not
by MPI: the same bits on every rank of every node.
"""
from __future__ import annotations

import weakref

import numpy as np

from .. import _engine
from ..frontend import calls, repro as _repro
from ..frontend.calls import (ALLGATHER, ALLTOALL, BARRIER, BROADCAST, EXSCAN, GATHER, REDUCE_SCATTER, SCAN,
                     SCATTER, split_bounds as _pieces)
from ..codes import (KIND_ALLGATHER, KIND_ALLTOALL, KIND_BARRIER, KIND_BROADCAST, KIND_EXSCAN,
                     KIND_GATHER, KIND_ROOT_STEP, KIND_SCAN, KIND_SCATTER)
from ..frontend.collectives import _fold, _identity
from ..errors import CollectiveMismatchError, ShmtreeError
from ..frontend.front import Front
from ..groups import session
from ..groups.group import Group  # noqa: F401  (multinode.from_mpi makes a node's group as nodes.Group)
from .agreement import (LOCAL_ERROR, NONE, _NOTHING, _Agreement, _apart, _bare, _free_key,
                        _no_extra, _row, _row_bytes, _row_of, _shape_text)
from .inter import Link
from ..groups.survive import Survive          # revoke; agree / shrink refused (issue 38)
from .pipelines import Pipelines
from .remote import SpanningMessages               # point-to-point (issue 24)

__all__ = ["Spanning"]

SEGMENT_BYTES = 4 << 20        # bytes per pipelined segment across the node boundary
SCAN_GATHER_BYTES = 64 << 10   # scan / exscan of at most this much (times the ranks): every
                               # input gathered everywhere, each rank folds its prefix
LANES_BYTES = 4 << 20          # from_mpi, nodes of one size: reductions from this size are
                               # cut among the lanes (_reduce_lanes), smaller ones run whole on
                               # every lane after the node's allreduce (_reduce_small_lanes)
_ALIVE = weakref.WeakSet()     # communicators to close before MPI finalizes (multinode)


class Spanning(Survive, SpanningMessages, _Agreement, Front, Pipelines):
    """A communicator across nodes: the node's shmtree group and MPI between the leaders.  The
    calls and their semantics are those of shmtree.Communicator (allreduce, broadcast, reduce,
    allgather, reduce_scatter, alltoall, gather, scatter, scan, exscan, barrier, their i-forms
    and persistent forms, empty and zeros: Front's); ranks are global.  With one node, the
    node's own communicator makes every call."""

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
            self._run, self._post = local._run, local._post
            self._quick, self._local_error = local._quick, local._local_error
            self._bind = local._bind     # (persistent calls: the node's bound engine call)
        _ALIVE.add(self)

    # the module-level calls see this object through shmtree.current()
    @property
    def _gen(self):
        return self.local._gen

    def __repr__(self):
        return (f"<shmtree.Spanning rank={self.rank} size={self.size} node={self.node}/"
                f"{self.nodes} node_rank={self.node_rank}/{self.node_size}>")

    # ---- the front end's hooks (front.py) ----

    def _run(self, spec):
        """A parsed call, blocking: its executor, guarded, on the node's executor."""
        self._check_open()
        return self.local._now(self._guarded(self._executor(spec), spec.deadline))

    def _post(self, spec):
        """A parsed call, nonblocking: a Request of the node's progress thread."""
        self._check_open()
        return self.local._enqueue(self._guarded(self._executor(spec), spec.deadline),
                                   spec.request_name)

    # (_quick: Front's, DECLINED; _local_error: Front's, raised here, each rank its own)

    def _shared_array(self, shape, dtype, order, how):
        """empty / zeros: shared within this node (a collective of the node's members); their
        errors name global ranks."""
        try:
            return getattr(self.local, how)(shape, dtype, order)
        except ShmtreeError as exc:
            if exc.args and isinstance(exc.args[0], str):
                exc.args = (self._global(exc.args[0]) + f" (in node {self.node})",) + \
                    exc.args[1:]
            raise

    def _executor(self, spec):
        """The function that runs a parsed call across the nodes (its `call`: its name)."""
        if spec.reproducible and spec.coll not in (SCAN, EXSCAN):
            return _repro.spanning(self, spec)        # (deterministic=True, Accumulator)
        return {BROADCAST: self._exec_broadcast, ALLGATHER: self._exec_allgather,
                BARRIER: self._exec_barrier, ALLTOALL: self._exec_alltoall,
                GATHER: self._exec_gather, SCATTER: self._exec_scatter,
                SCAN: self._exec_scan, EXSCAN: self._exec_scan,
                }.get(spec.coll, self._exec_reducing)(spec)

    def _local_error(self, spec):
        """A rooted call's local error that only this rank can see (its dtype holds Python
        objects, or has no kernel): said in the call's agreement round (a row of its own), so
        that every other rank of every node raises CollectiveMismatchError naming this rank
        instead of waiting for it; then raised here."""
        if self.nodes > 1:
            kind = spec.kind % KIND_ROOT_STEP
            row = _bare(kind, -1 if spec.root is None else spec.root, 0, LOCAL_ERROR)

            def run():
                try:
                    self._check(self._agree(row, spec.deadline))
                except CollectiveMismatchError:
                    pass
            run.call = spec.name
            self.local._now(self._guarded(run, spec.deadline))
        return spec.error

    def stats(self) -> dict:
        return self.local.stats()

    def close(self):
        """Leave: the node's communicator closes, the leader's link thread stops, and the node's
        group is closed by the process that created it.  (Local, like Communicator.close.)"""
        if self._closed:
            return
        self._closed = True
        try:
            self._messages_close()       # (remote.py: outstanding isends between nodes first)
            self.local.close()
        finally:
            for link in {self._link, self._lane} - {None}:
                link.close()
            self.group.close()
            if session._current is self:
                session._set_current(None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __reduce__(self):
        raise TypeError("shmtree: a communicator cannot be sent to another process")

    # ---- allreduce, reduce, reduce_scatter ----

    def _exec_reducing(self, spec):
        """allreduce, reduce or reduce_scatter of a parsed call (out= as calls.destination
        takes it: an array of the input's shape, or a writable buffer of its size)."""
        a, op, out, root, deadline = spec.array, spec.op, spec.out, spec.root, spec.deadline
        scatter = spec.coll == REDUCE_SCATTER
        if scatter:
            b = _pieces(a.shape[0], self.size)
            lo, hi = b[self.rank], b[self.rank + 1]
        row = _row(spec.kind % KIND_ROOT_STEP, -1 if root is None else root, spec.opc, a)

        def run():
            table = self._agree(row, deadline)
            self._check(table)
            src = np.ascontiguousarray(a).reshape(-1)
            deliver = root is None or self._where[root][0] == self.node
            fold = self._reduce_lanes if self._lane is not None and \
                src.nbytes >= LANES_BYTES else self._reduce_pipeline
            if scatter:
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
            result, dst, copy_back = calls.destination(a, out)
            flat = dst.reshape(-1)
            if _engine.clash(src, flat):
                src = src.copy()          # out overlaps the input without being it
            fold(src, flat, op, deliver, deadline)
            if copy_back is not None:
                copy_back[...] = dst.reshape(copy_back.shape)
            return result
        run.call = spec.name + (f"(root={root})" if root is not None else "")
        return run

    # ---- broadcast ----

    def _exec_broadcast(self, spec):
        """broadcast of a parsed call.  spec.array is None on a rank that passed None and no
        out= (it agrees with any shape and dtype of the root's); one that passed only out=
        claims out's shape and dtype (calls.broadcast)."""
        a, root, out, deadline = spec.array, spec.root, spec.out, spec.deadline
        row = _row(KIND_BROADCAST, root, 0, a) if a is not None else \
            _bare(KIND_BROADCAST, root, 0, NONE)

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
            result, copy_back = calls.out_for(out, shape, dtype, "broadcast")
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
            return calls.finish(result, copy_back)
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

    # ---- allgather ----

    def _exec_allgather(self, spec):
        """allgather of a parsed call (axis None: stacked; 0: concatenated)."""
        a, axis, out, deadline = spec.array, spec.axis, spec.out, spec.deadline
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
            result, copy_back = calls.out_for(out, shape, a.dtype, "allgather")
            self._allgather_data(a, axis, lengths, rowbytes, result, deadline)
            return calls.finish(result, copy_back)
        run.call = "allgather"
        return run

    def _allgather_data(self, a, axis, lengths, rowbytes, result, deadline):
        """allgather's data (after its agreement): every rank's `a` into `result` (C-contiguous),
        in global rank order: in the node, between the leaders, broadcast in the node."""
        mine = np.ascontiguousarray(a)
        # this node's blocks, by local rank, on every member
        if self.node_size > 1:
            node_blocks = self.local.run(calls.allgather(self.local, mine, axis, None,
                                                         self._remaining(deadline)))
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
            self._leaders_allgatherv(mine_raw, gathered, sizes, deadline)
            if not self._in_order:
                self._place(gathered, flat, lengths, rowbytes)
        if self.node_size > 1 and total:
            self._intra_bcast(flat if self.node_rank == 0 else None, flat, deadline)

    # ---- alltoall, gather, scatter, scan, exscan: exchanges across nodes ----
    #
    # Each is: the agreement (plus, for alltoall(counts=), a second round of every rank's
    # counts), the byte matrix B of who sends what to whom (from the table: the same on every
    # rank), and one exchange across nodes (pipelines._exchange_nodes); scan and exscan two.

    def _exec_alltoall(self, spec):
        """alltoall of a parsed call: equal blocks (counts None), or counts= rows to each rank."""
        a, out, deadline, counts = spec.array, spec.out, spec.deadline, spec.counts
        counted = counts is not None
        row = _row(KIND_ALLTOALL, -1, int(counted), a, free=counted)

        def run():
            P, me = self.size, self.rank
            table = self._agree(row, deadline)
            self._check(table, _free_key if counted else tuple)
            rowbytes = _row_bytes(a)
            if counted:      # every rank's counts, and the rows of its out= (-1: none)
                mine = list(counts) + [-1 if out is None else out.shape[0]]
                C = self._agree(mine, deadline)
                got = C[:, :P].sum(axis=0)
                wrong = [g for g in range(P) if C[g, P] not in (-1, got[g])]
                if wrong:
                    raise CollectiveMismatchError(
                        "shmtree: ranks disagree on the collective call across nodes: "
                        "alltoall(counts): " + "; ".join(
                            f"rank {g} (node {self._where[g][0]}) passed out= of {C[g, P]} "
                            f"rows and receives {got[g]}" for g in wrong))
                B = C[:, :P] * rowbytes
                shape = (int(got[me]),) + a.shape[1:]
            else:
                B = np.full((P, P), a.nbytes // P if P else 0, np.int64)
                shape = a.shape
            result, copy_back = calls.out_for(out, shape, a.dtype, "alltoall")
            dst = calls.bytes_of(result)
            self._exchange_nodes(_apart(calls.bytes_of(a), dst), dst, B, deadline)
            return calls.finish(result, copy_back)
        run.call = "alltoall(counts)" if counted else "alltoall"
        return run

    def _exec_gather(self, spec):
        """gather of a parsed call: to the root's node leader across nodes, in the nodes on
        either side (the byte count of each rank's block is in its row)."""
        a, out, deadline, root, axis = spec.array, spec.out, spec.deadline, spec.root, spec.axis
        free = axis == 0
        mine = self.rank == root
        row = _row(KIND_GATHER, root, int(free), a, free=free,
                   extra=out.shape[0] if mine and free and out is not None else -1)

        def run():
            P = self.size
            table = self._agree(row, deadline)
            self._check(table, _free_key if free else _no_extra)
            nb = table[:, 5].astype(np.int64)
            if free:
                n = int(table[:, 7].sum())
                want = int(table[root, 10])
                if want not in (-1, n):
                    raise CollectiveMismatchError(
                        f"shmtree: ranks disagree on the collective call across nodes: "
                        f"gather(root={root}): the root passed out= of {want} rows, the ranks "
                        f"send {n}")
                shape = (n,) + a.shape[1:]
            else:
                shape = (P,) + a.shape
            B = np.zeros((P, P), np.int64)
            B[:, root] = nb
            if mine:
                result, copy_back = calls.out_for(out, shape, a.dtype, "gather")
                dst = calls.bytes_of(result)
            else:
                result, copy_back, dst = None, None, _NOTHING
            self._exchange_nodes(_apart(calls.bytes_of(a), dst), dst, B, deadline)
            return calls.finish(result, copy_back) if mine else None
        run.call = f"gather(root={root})"
        return run

    def _exec_scatter(self, spec):
        """scatter of a parsed call: from the root's node leader across nodes, in the nodes on
        either side.  The root's dtype and shape reach every rank first (as a broadcast's do
        for ranks that passed None); an out= elsewhere claims its block (checked then, on every
        rank alike)."""
        a, out, deadline, root, axis = spec.array, spec.out, spec.deadline, spec.root, spec.axis
        mode = int(axis == 0)
        if a is not None:
            row = _row(KIND_SCATTER, root, mode, a)
        elif out is not None:
            row = _row(KIND_SCATTER, root, mode, out)
        else:
            row = _bare(KIND_SCATTER, root, mode, NONE)

        def run():
            P, me = self.size, self.rank
            table = self._agree(row, deadline)
            self._check(table, lambda r: tuple(r[:3]))
            rnode, rlocal = self._where[root]
            src = np.ascontiguousarray(a) if me == root else None
            dtype, shape = self._meta(src, rnode, rlocal, deadline)
            if axis is None:
                blocks = [tuple(shape[1:])] * P
            else:
                b = _pieces(shape[0], P)
                blocks = [(b[g + 1] - b[g],) + tuple(shape[1:]) for g in range(P)]
            wrong = [g for g in range(P) if g != root and table[g, 5] != NONE and
                     list(table[g]) != _row_of(KIND_SCATTER, root, mode, blocks[g], dtype)]
            if wrong:
                raise CollectiveMismatchError(
                    f"shmtree: ranks disagree on the collective call across nodes: "
                    f"scatter(root={root}): the root passed shape {tuple(shape)} and dtype "
                    f"{calls.dtype_text(calls.dtype_digest(dtype))}; " + "; ".join(
                        f"rank {g} (node {self._where[g][0]}) passed out= of shape "
                        f"{_shape_text(table[g])} and dtype {calls.dtype_text(table[g, 3])}, "
                        f"its block has shape {blocks[g]}" for g in wrong))
            result, copy_back = calls.out_for(out, blocks[me], dtype, "scatter")
            nb = [dtype.itemsize * int(np.prod(blk, dtype=np.int64)) for blk in blocks]
            B = np.zeros((P, P), np.int64)
            B[root] = nb
            dst = calls.bytes_of(result)
            self._exchange_nodes(_apart(calls.bytes_of(src), dst) if src is not None
                                 else _NOTHING, dst, B, deadline)
            return calls.finish(result, copy_back)
        run.call = f"scatter(root={root})"
        return run

    def _exec_scan(self, spec):
        """scan / exscan of a parsed call, bit for bit numpy's accumulate in global rank order
        whatever the placement of ranks on nodes: every number is folded by one rank, in rank
        order (docs/algorithms.md, "Across nodes").  Small: every input gathered everywhere
        (the allgather's steps), each rank folds its own prefix.  Else the transpose: exchange
        1 sends block q (np.array_split of the items into size pieces) of every rank to rank q,
        which folds its rows in rank order; exchange 2 sends prefix row r back to rank r."""
        a, out, deadline, opc = spec.array, spec.out, spec.deadline, spec.opc
        exclusive = spec.coll == EXSCAN
        row = _row(spec.kind, -1, opc, a)     # (KIND_SCAN, KIND_EXSCAN, or deterministic's)

        def run():
            P, me = self.size, self.rank
            table = self._agree(row, deadline)
            self._check(table)
            dt = a.dtype
            result, dst, copy_back = calls.destination(a, out)
            src = np.ascontiguousarray(a)
            if a.nbytes * P <= SCAN_GATHER_BYTES:
                stack = np.empty((P,) + a.shape, dt)
                self._allgather_data(src, None, [1] * P, a.nbytes, stack, deadline)
                upto = me if exclusive else me + 1
                dst[...] = _identity(opc, dt, a.shape) if upto == 0 else \
                    _fold(stack[:upto], opc)[-1]
            else:
                n = a.size
                b = _pieces(n, P)
                sizes = np.array([b[q + 1] - b[q] for q in range(P)], np.int64)
                m = int(sizes[me])
                rows = np.empty((P, m), dt)
                flat = dst.reshape(-1)
                self._exchange_nodes(_apart(calls.bytes_of(src), calls.bytes_of(flat)),
                                     calls.bytes_of(rows),
                                     np.tile(sizes * dt.itemsize, (P, 1)), deadline)
                if exclusive:
                    prefix = np.empty((P, m), dt)
                    prefix[0] = _identity(opc, dt, (m,))
                    if P > 1:
                        prefix[1:] = _fold(rows[:P - 1], opc)
                else:
                    prefix = _fold(rows, opc)
                self._exchange_nodes(calls.bytes_of(prefix), calls.bytes_of(flat),
                                     np.tile((sizes * dt.itemsize)[:, None], (1, P)), deadline)
            if copy_back is not None:
                copy_back[...] = dst.reshape(copy_back.shape)
            return result
        run.call = "exscan" if exclusive else "scan"
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

    def _exec_barrier(self, spec):
        deadline = spec.deadline
        row = _bare(KIND_BARRIER, -1, 0, 0)

        def run():
            table = self._agree(row, deadline)      # (every rank arrived: that is the barrier)
            self._check(table)
        run.call = "barrier"
        return run
