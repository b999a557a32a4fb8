"""How a Transport (messages.py) waits and fails: what its posted operations wait for, the checks
between two slices of waiting (the group, the peers, the deadlines), and the failure of every
operation once a peer is gone or the group aborted (a mixin of Transport)."""
from __future__ import annotations

from .. import _p2p
from ..codes import (ABORT_DIED, ABORT_FAILED, ABORT_LEFT, ABORT_STALL, ABORT_TIMEOUT, ST_BUSY,
                     ST_IDLE, ST_LEFT)
from ..errors import CollectiveTimeoutError, PeerLostError, ShmtreeError
from .records import ANY_SOURCE, ANY_TAG, LOOK_S, _G, _broken_text
from ..groups.survive import lost_error


class _Waiting:
    """Transport's waiting and failing (see the module's docstring)."""

    # ---- waiting ----

    def conds(self):
        """What the posted operations wait for: (ring, bytes) pairs for Home.wait, whether
        some source's channel is still missing, and (an ANY_SOURCE receive posted) the count
        of channels made to this rank that a new sender's channel changes (else None)."""
        conds, missing = [], False
        for dest, q in self.sends.items():
            got = self.out.get(dest)
            if got is not None and q:
                op = q[0]
                if op.phase == 0:
                    need = op.header.size - op.pos
                elif op.phase == 1:
                    need = min(op.nbytes - op.pos, _p2p.PIECE)
                elif op.cma and not op.pad:
                    need = got[2].capacity          # (the ring empty: the record read)
                else:
                    need = op.pad
                conds.append((got[2], max(1, min(need, got[2].capacity))))
        for src in set(self.recvs) | set(self.incoming):
            got = self.inn.get(src)
            if got is None:
                missing = True
                continue
            inc = self.incoming.get(src)
            if inc is None:
                need = _G
            elif inc.pos < inc.nbytes:
                need = min(inc.nbytes - inc.pos, _p2p.PIECE)
            else:
                need = inc.pad
            conds.append((got[1], max(1, need)))
        made = None
        if self.any_recvs:              # (every other channel: its next record)
            made = self.made_seen if self.made_seen is not None else self.home.made()
            for src, got in self.inn.items():
                if src not in self.recvs and src not in self.incoming:
                    conds.append((got[1], _G))
        return conds, missing, made

    def peers_waited_for(self):
        peers = set(self.sends) | set(self.recvs) | set(self.incoming)
        return peers | set(range(self.size)) if self.any_recvs else peers

    def all_ops(self):
        ops = [op for q in self.sends.values() for op in q]
        ops += [op for rs in self.recvs.values() for op in rs]
        ops += self.any_recvs
        ops += [inc.op for inc in self.incoming.values() if inc.op is not None]
        ops += [k.claimant for ks in self.kept.values() for k in ks if k.claimant is not None]
        return [op for op in ops if not op.done]

    def check(self, now):
        """Between slices (under the lock): the group, the peers, the deadlines.  Raises (after
        aborting the group) or fails the operations it concerns."""
        comm = self.comm
        group = self.group
        if self.closed or comm._closed:
            self.fail_all(ShmtreeError("shmtree: this communicator is closed"))
            return
        if group._closed:
            self.fail_all(ShmtreeError("shmtree: the group is closed"))
            return
        if group.aborted():
            self.fail_all(None)
            return
        ops = self.all_ops()
        for op in ops:
            p = op.peer
            if p == ANY_SOURCE:
                if self._check_any(op, now):
                    return
                continue
            if p == self.rank:
                continue
            member = p < group.size       # (else the node's launcher, inter=: relay.Relay)
            state = group._seg.state(p) if member else ST_BUSY
            how = group.death_of(p) if state != ST_LEFT and member else ""
            if self.relay and (state == ST_LEFT or how):
                op.finish(error=ShmtreeError(f"shmtree: rank {p} left"))    # (the launcher:
                continue                                                   # not an error)
            if state == ST_LEFT or how:
                self.progress()       # (what the peer did before it went counts: look again)
                if op.done:
                    continue
            if state == ST_LEFT and self._never(op):
                text = (f"rank {p} left the group (closed its communicator or returned from its "
                        f"function) while rank {self.rank} waited in {op.kind} "
                        f"{'to' if op.kind == 'send' else 'from'} it (tag {op.tag})")
                self._abort(ABORT_LEFT, text)
                self.fail_all(ShmtreeError(f"shmtree: rank {self.rank}: {text}; the group is "
                                           "aborted"), op)
                return
            if how:
                group.abort(ABORT_DIED, p)
                self.fail_all(PeerLostError(f"shmtree: rank {self.rank}: rank {p} died ({how}) "
                                            f"while rank {self.rank} waited in {op.kind} "
                                            f"{'to' if op.kind == 'send' else 'from'} it; the "
                                            "group is aborted"), op)
                return
            if op.deadline is not None and now >= op.deadline:
                peer, tag = (f"rank {p}", op.tag) if member or not self.relayed else \
                    (f"global rank {op.tag % self.relayed} of another node, through the "
                     "launcher", op.tag // self.relayed)
                text = (f"rank {self.rank} timed out in {op.kind} "
                        f"{'to' if op.kind == 'send' else 'from'} {peer} (tag {tag})")
                self._abort(ABORT_TIMEOUT, text)
                self.fail_all(CollectiveTimeoutError(f"shmtree: {text}; the group is aborted"),
                              op)
                return
            if self.stall_timeout is not None and state == ST_IDLE:
                since = self.idle_since.setdefault(p, now)
                if now - since >= self.stall_timeout:
                    text = (f"{op.kind} {'to' if op.kind == 'send' else 'from'} rank {p} cannot "
                            f"complete in the Pool: rank {self.rank} waited for it for "
                            f"{now - since:.1f} s while rank {p} was idle (no task, or finished "
                            f"its task without making the matching call)")
                    self._abort(ABORT_STALL, text)
                    self.fail_all(ShmtreeError(f"shmtree: rank {self.rank}: {text}; the group "
                                               "is aborted"), op)
                    return
            else:
                self.idle_since.pop(p, None)

    def _check_any(self, op, now):
        """check() of a receive from ANY_SOURCE: it fails (True: after failing every posted
        operation, as for one peer) once no other rank can ever send it anything - each died,
        or left with nothing unread (PeerLostError when one died) - or at its deadline, or in a
        Pool when every other rank has been idle for the stall timeout; while one lives and
        may send, it waits."""
        group = self.group
        if now - self.looked_at >= LOOK_S:
            self.made_seen = None     # (the next progress looks again)
        others = [p for p in range(self.size) if p != self.rank]
        gone = {}
        for p in others:
            state = group._seg.state(p)
            how = group.death_of(p) if state != ST_LEFT else ""
            if state != ST_LEFT and not how:
                break
            gone[p] = how or "left"
        if others and len(gone) == len(others):
            self.progress()           # (what they sent before they went counts: look again)
            self._find_senders()
            if op.done or any(self._unread(p) for p in others):
                return False
            died = [p for p, how in gone.items() if how != "left"]
            said = "; ".join(f"rank {p} {'left the group' if how == 'left' else f'died ({how})'}"
                             for p, how in gone.items())
            text = (f"every other rank is gone ({said}) while rank {self.rank} waited in recv "
                    f"from ANY_SOURCE (tag {'ANY_TAG' if op.tag == ANY_TAG else op.tag}): no "
                    "message can come")
            if died:
                group.abort(ABORT_DIED, died[0])
                self.fail_all(PeerLostError(f"shmtree: rank {self.rank}: {text}; the group is "
                                            "aborted"), op)
            else:
                self._abort(ABORT_LEFT, text)
                self.fail_all(ShmtreeError(f"shmtree: rank {self.rank}: {text}; the group is "
                                           "aborted"), op)
            return True
        if op.deadline is not None and now >= op.deadline:
            text = (f"rank {self.rank} timed out in recv from ANY_SOURCE (tag "
                    f"{'ANY_TAG' if op.tag == ANY_TAG else op.tag})")
            self._abort(ABORT_TIMEOUT, text)
            self.fail_all(CollectiveTimeoutError(f"shmtree: {text}; the group is aborted"), op)
            return True
        if self.stall_timeout is not None and others:
            idle = []
            for p in others:
                if group._seg.state(p) == ST_IDLE:
                    idle.append(now - self.idle_since.setdefault(p, now))
                else:
                    self.idle_since.pop(p, None)
            if len(idle) == len(others) and min(idle) >= self.stall_timeout:
                text = (f"recv from ANY_SOURCE cannot complete in the Pool: rank {self.rank} "
                        f"waited for it for {min(idle):.1f} s while every other rank was idle "
                        "(no task, or finished its task without sending)")
                self._abort(ABORT_STALL, text)
                self.fail_all(ShmtreeError(f"shmtree: rank {self.rank}: {text}; the group is "
                                           "aborted"), op)
                return True
        return False

    def _unread(self, p):
        """Bytes in rank p's channel to this rank not yet read (0: none, or no channel)."""
        got = self.inn.get(p)
        ring = got[1] if got is not None else self._in_ring(p)
        return 0 if ring is None else ring.unread()

    def _never(self, op):
        """The peer has left: can op never complete?  (A recv still can while the ring holds
        data: the state was read first.)"""
        if op.kind == "send":
            return True
        got = self.inn.get(op.peer)
        ring = got[1] if got is not None else self._in_ring(op.peer)
        return ring is None or ring.unread() == 0

    def _abort(self, reason, text):
        self.group.abort(reason, self.rank, note=text)

    def fail_all(self, exc, op=None):
        """Fail every posted operation (the group is aborted, closed): `op` with exc, the
        others with PeerLostError (exc None: all of them)."""
        lost = lost_error(self.group)(f"shmtree: rank {self.rank}: "
                                      f"{self.group.describe_abort()}") \
            if not self.group._closed else ShmtreeError("shmtree: the group is closed")
        if exc is not None and op is None:
            lost = exc
        self._fail_ops(exc, op, lost)
        self.sends.clear()
        self.incoming.clear()

    def _broken(self, exc):
        what = _broken_text(exc)
        if not self.group._closed and not self.group.aborted():
            self._abort(ABORT_FAILED, f"rank {self.rank}: {what}")
        with self.lock:
            self.fail_all(exc if isinstance(exc, ShmtreeError) else
                          ShmtreeError(f"shmtree: rank {self.rank}: {what}; the group is aborted"))
            finished = self._finished_requests()
        self._complete(finished)

    def _wait(self, conds, missing, made, budget):
        """Wait (outside the lock) for what conds() said: the conds, a missing sender's channel
        (looked up again after each ring), a new channel for an ANY_SOURCE receive (made: the
        count of channels made to this rank when its senders were last looked for)."""
        ns = max(100_000, int(budget * 1e9))
        if missing:                  # a sender's channel to look for: it rings when it makes it
            seen = self.home.hold()
            try:
                with self.lock:
                    for src in set(self.recvs) | set(self.incoming):
                        if src not in self.inn and self._in_ring(src) is not None:
                            return
                    if made is not None and self.home.made() != made:
                        return
                    ready = any(r.avail() >= n if not r.sender else r.room() >= n
                                for r, n in conds)
                if not ready:
                    self.home.sleep(seen, ns)
            finally:
                self.home.unhold()
        else:
            self.home.wait(conds, ns, self.spin_ns, -1 if made is None else made)

    def _wake(self):
        self.home.ring()
