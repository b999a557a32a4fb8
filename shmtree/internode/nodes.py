"""Collectives across nodes: a node's shared-memory group plus MPI between the nodes' leaders.

Spanning (docs/design.md, "Across nodes (MPI)") spans every node: the processes that share a
node form a shmtree group of their own, whose local rank 0 is the node's leader and owns the
inter-node Link (shmtree.internode.inter).  rank and size are global; node, nodes: this node's index
(nodes ordered by their smallest global rank) and their count; node_rank, node_size.  It is a
Front (front.py): its calls are parsed by calls.py, and each CallSpec runs on an executor here
(_exec_*), as one function on the node's communicator's executor.  shmtree.internode.multinode forms it
(from_mpi; a launcher per node, Group(..., inter=)).

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

import re
import time
import weakref

import numpy as np

from .. import calls
from ..groups import session
from ..calls import ALLGATHER, ALLTOALL, BARRIER, BROADCAST, EXSCAN, GATHER, SCAN, SCATTER
from ..codes import ABORT_FAILED, ABORT_TIMEOUT, KIND_ROOT_STEP, ranks_text
from ..errors import CollectiveMismatchError, CollectiveTimeoutError, PeerLostError, ShmtreeError
from ..front import Front
from .remote import SpanningMessages               # point-to-point (issue 24)
from .pipelines import Pipelines
from ..groups.group import Group  # noqa: F401  (multinode.from_mpi makes a node's group as nodes.Group)
from .inter import TIMEOUT_ACROSS as _ACROSS, Link, LinkTimeout, global_ranks
from .executors import LOCAL_ERROR, _bare, _describe, _Executors

__all__ = ["Spanning"]

SEGMENT_BYTES = 4 << 20        # bytes per pipelined segment across the node boundary
_ALIVE = weakref.WeakSet()     # communicators to close before MPI finalizes (multinode)
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


class Spanning(SpanningMessages, _Executors, Front, Pipelines):
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
