"""How Spanning (nodes.py) runs a call across nodes: each call is one prepared function on the
node's executor, guarded (a node's failure, a timeout, said in the words of the whole
communicator), after an agreement - every rank's row (_row: what it was called with) gathered
and compared on every rank (_check) - so that a mismatch raises on every rank before any data
moves (a mixin of Spanning, and the rows its executors build)."""
from __future__ import annotations

import re
import time

import numpy as np

from ..frontend import calls
from ..codes import (ABORT_FAILED, ABORT_TIMEOUT, KIND_ALLGATHER, KIND_ALLREDUCE, KIND_ALLTOALL,
                     KIND_BARRIER, KIND_BROADCAST, KIND_EXSCAN, KIND_GATHER, KIND_NAMES,
                     KIND_REDUCE, KIND_REDUCE_SCATTER, KIND_SCAN, KIND_SCATTER, ranks_text)
from ..errors import CollectiveMismatchError, CollectiveTimeoutError, PeerLostError, ShmtreeError
from ..ops import OP_NAMES
from .inter import TIMEOUT_ACROSS as _ACROSS, LinkTimeout, global_ranks

ROW = 11                       # int64 per rank in the agreement table (_row)
NONE, LOCAL_ERROR = -1, -3     # a row's byte count: passed None (broadcast, scatter away from
                               # the root); a local error said in the round (_local_error)
# a node's own step in its messages ("broadcast(root=0) #2"), and the messages of the links
# (already in the words of the whole communicator)
_STEP = re.compile(r"\b(?:allreduce|barrier|allgather|reduce_scatter|alltoall(?:\(counts\))?|"
                   r"scan|exscan|(?:broadcast|reduce|gather|scatter)\(root=\d+\)) #\d+")
LATE_SLACK_S = 0.5           # (Spanning._timeout_words: a rank this much short of its own
                             # deadline arrived late, and raises PeerLostError)
_FROM_LINK = re.compile(r"shmtree: (node \d|timed out waiting for the other nodes)")


def _bare_text(text, rank):
    """A failure's words without the raising rank's prefix ("shmtree: rank 3: ") and the
    group's suffix ("; the group is aborted"), with one "shmtree: " in front."""
    for head in ("shmtree: ", f"rank {rank}: "):
        text = text.removeprefix(head)
    return "shmtree: " + text.removesuffix("; the group is aborted")


def _row(kind, root, opc, a, free=False, extra=-1):
    """A rank's description of its call: kind, root, op (or a mode: alltoall's counts=,
    gather's and scatter's axis=0), dtype digest, dtype number, byte count, ndim, first two
    dimensions, shape digest (of the dimensions after the first when `free`: lengths along
    axis 0 may differ), and an extra number (gather(axis=0)'s root: the rows of its out=)."""
    return _row_of(kind, root, opc, a.shape, a.dtype, free, extra)


def _row_of(kind, root, opc, shape, dtype, free=False, extra=-1):
    shape = tuple(shape)
    d0 = shape[0] if len(shape) > 0 else 0
    d1 = shape[1] if len(shape) > 1 else 0
    free = free or (kind == KIND_ALLGATHER and root == 0)
    digest = hash(shape[1:] if free else shape) & 0x7fffffffffffffff
    nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    return [kind, root, opc, calls.dtype_digest(dtype), dtype.num, nbytes, len(shape),
            d0, d1, digest, extra]


def _bare(kind, root, opc, nbytes):
    """A row without an array (barrier; None; a local error)."""
    return [kind, root, opc, 0, 0, nbytes, 0, 0, 0, 0, -1]


def _free_key(r):
    """Rows of calls whose lengths along axis 0 may differ: all but the byte count, the first
    dimension and the extra number."""
    return (tuple(r[:5]), r[6], r[8], r[9])


def _no_extra(r):
    return tuple(r[:10])


def _row_bytes(a):
    return a.dtype.itemsize * int(np.prod(a.shape[1:], dtype=np.int64))


def _apart(src, dst):
    """src, or a copy of it when it shares memory with dst (an exchange reads every input
    while it writes every output)."""
    return src.copy() if src.size and dst.size and np.may_share_memory(src, dst) else src


_NOTHING = np.empty(0, np.uint8)


def _shape_text(r):
    """A row's shape in words: its first two dimensions, '...' for more."""
    ndim = int(r[6])
    dims = [str(int(r[7])), str(int(r[8]))][:ndim] + (["..."] if ndim > 2 else [])
    return "(" + ", ".join(dims) + ("," if ndim == 1 else "") + ")"


def _describe(r):
    kind, root, opc = int(r[0]), int(r[1]), int(r[2])
    name = KIND_NAMES.get(kind, "collective")
    if kind == KIND_BARRIER:
        return "barrier"
    if r[5] == NONE:
        return f"{name}(root={root}, None)"
    if r[5] == LOCAL_ERROR:
        return (f"{name}(root={root})" if kind in (KIND_BROADCAST, KIND_REDUCE, KIND_GATHER,
                                                    KIND_SCATTER) else name) + \
            " with an argument it cannot take (its own error raised there)"
    shape = _shape_text(r)
    parts = [f"root={root}"] if kind in (KIND_BROADCAST, KIND_REDUCE, KIND_GATHER,
                                         KIND_SCATTER) else []
    if kind == KIND_ALLTOALL and opc:
        parts.append("counts=...")
    parts.append(f"shape={shape}")
    parts.append(f"dtype={calls.dtype_text(int(r[3]))}")
    if kind in (KIND_ALLREDUCE, KIND_REDUCE, KIND_REDUCE_SCATTER, KIND_SCAN, KIND_EXSCAN):
        parts.append(f"op={OP_NAMES.get(opc, opc)!r}")
    if kind == KIND_ALLGATHER:
        parts.append("axis=None" if root == -1 else "axis=0")
    if kind in (KIND_GATHER, KIND_SCATTER):
        parts.append("axis=0" if opc else "axis=None")
    return f"{name}({', '.join(parts)})"


class _Agreement:
    """Spanning's running of a call and its agreement (see the module's docstring)."""

    # ---- running a call: every call is one prepared function on the node's executor ----

    def _check_open(self):
        if self._closed:
            raise ShmtreeError("shmtree: this communicator is closed")
        for link in (self._link, self._lane):
            if link is not None and link.failure is not None:
                raise PeerLostError(f"shmtree: rank {self.rank}: "
                                    f"{link.failure.removeprefix('shmtree: ')}")

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

    def _guarded(self, run, deadline=None):
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
                said = self._timeout_words(exc, call, deadline)
                if said is not None:
                    # a step across nodes ran out of time (this rank's, another leader's, or
                    # this node's leader's): every rank that waited raises the same words, in
                    # global ranks, naming the ranks that had not arrived (the node's members
                    # wait LEADER_GRACE_S longer than their leader, whose words these are)
                    for link in {self._link, self._lane} - {None}:
                        link.abort(said)
                    if not self.group.closed and not self.group.aborted():
                        self.group.abort(ABORT_TIMEOUT, self.node_rank, note=said)
                    raise CollectiveTimeoutError(said) from None
                if isinstance(exc, ShmtreeError) and exc.args and \
                        isinstance(exc.args[0], str) and not _FROM_LINK.match(exc.args[0]) \
                        and not _ACROSS.match(exc.args[0]):
                    exc.args = (self._global(exc.args[0], call),) + exc.args[1:]
                text = (f"node {self.node} (rank {self.rank}) failed in {call}: "
                        f"{type(exc).__name__}: {exc}")
                for link in {self._link, self._lane} - {None}:
                    link.abort(text)
                if not self.group.closed and not self.group.aborted():
                    self.group.abort(ABORT_FAILED, self.node_rank, note=text)
                raise
        return guarded

    def _timeout_words(self, exc, call, deadline):
        """The words of a timeout across nodes that `exc` reports, else None: this rank's own
        (a LinkTimeout), or another rank's when this call's own deadline has passed too (a rank
        that arrived after the others had timed out raises PeerLostError, as in one node)."""
        if isinstance(exc, LinkTimeout):
            return (f"shmtree: rank {self.rank} timed out in {call}; "
                    f"{self._absent_nodes(exc.waiting, exc.exact)} had not arrived")
        if isinstance(exc, CollectiveTimeoutError):        # in the node (its ranks' words)
            text = _bare_text(self._global(str(exc), call), self.rank)
            return text if _ACROSS.match(text) else None
        if not isinstance(exc, PeerLostError) or deadline is None or \
                time.monotonic() < deadline - LATE_SLACK_S:
            return None
        text = _bare_text(str(exc), self.rank)
        if _ACROSS.match(text):                # another leader's, through the link
            return text
        return self._leader_timed_out()        # this node's leader's, through the node's group

    def _leader_timed_out(self):
        """The words of this node's leader when it aborted the node's group because its step
        across nodes timed out (a member waiting in the same call raises them, as a
        CollectiveTimeoutError), else None."""
        group = self.group
        if group.closed or group._seg.abort_state() != (ABORT_TIMEOUT, 0):
            return None
        note = group._seg.note(0)
        return note if _ACROSS.match(note) else None

    def _absent_nodes(self, nodes, exact):
        """Words for the ranks of the given nodes that a step across nodes waited for: the
        global ranks, by node; "a rank of" where a node has several (its leader sends for all
        of them, once every one has arrived) or the step cannot tell which node (an MPI
        collective request)."""
        exact = exact or len(nodes) == 1
        parts = []
        for m in nodes:
            members = self._members[m]
            who = ranks_text(members)
            parts.append(f"{who} (node {m})" if len(members) == 1 and exact
                         else f"{'a rank' if exact else 'ranks'} of node {m} ({who})")
        joined = ", ".join(parts)
        return joined if exact else f"one or more of: {joined},"


    # ---- agreement ----

    def _agree(self, row, deadline):
        """Every rank's row, in global rank order (a (size, len(row)) int64 table), the same on
        every rank: gathered in the node, exchanged between the leaders, broadcast back.  (Every
        rank's row has the same length: ROW, or a second round's whose length every rank knew
        from the first, alltoall's counts.)"""
        P, link = self.size, self._link
        mine = np.asarray(row, np.int64)
        width = mine.size
        if self.node_size > 1:
            table = self.local.run(calls.allgather(self.local, mine, None, None,
                                                   self._remaining(deadline)))
        else:
            table = mine[None, :]
        full = table if self.nodes == 1 else None
        if link is not None:
            counts = [len(m) * width * 8 for m in self._members]
            full = np.empty((P, width), np.int64)
            self._leaders_allgatherv(table.reshape(-1).view(np.uint8),
                                     full.reshape(-1).view(np.uint8), counts, deadline)
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
        for g in range(self.size):       # (a local error said in the round: never the same call)
            key = ("error", g) if table[g][5] == LOCAL_ERROR else compare(table[g])
            seen.setdefault(key, []).append(g)
        if len(seen) > 1:
            def text(rs):
                nodes = ",".join(str(n) for n in sorted({self._where[r][0] for r in rs}))
                row = next((table[g] for g in rs if table[g][5] != -1), table[rs[0]])
                return f"{ranks_text(rs)} (node {nodes}): {_describe(row)}"
            parts = "; ".join(text(rs) for rs in seen.values())
            raise CollectiveMismatchError(
                f"shmtree: ranks disagree on the collective call across nodes: {parts}")
