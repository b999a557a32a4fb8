"""The worker side of inter= (mailbox.py: the mailbox and the launcher's side): ProxyLink, the
Link of a node's leader whose steps between nodes its launcher runs (mailbox.Proxy), handed over
through the mailbox."""
from __future__ import annotations

import time

import numpy as np

from ..errors import CollectiveTimeoutError, PeerLostError, ShmtreeError
from .inter import Link
from .mailbox import (ALLGATHERV, ALLREDUCE, BCAST, EXCHANGE, FAILED, SLOTS, SPLIT, SUBMITTED,
                      WAIT_SLICE_S, Proxy, _dtype_key)

__all__ = ["ProxyLink"]

# ---------------------------------------------------------------------------------------------
# the worker side: the node's leader


class _Job:
    __slots__ = ("slot", "step", "out", "at")

    def __init__(self, slot, step, out, at):
        self.slot, self.step, self.out, self.at = slot, step, out, at   # at: result offset


class ProxyLink:
    """The leader's link through its launcher: the interface of shmtree.internode.inter.Link."""

    def __init__(self, mailbox, owned=False):
        self.box = mailbox
        self.capacity = mailbox.segment
        self._next = 0
        self._owned = owned          # a sub-communicator's: closing it stops its proxy

    @property
    def failure(self):
        box = self.box
        return box.get_text(1024) or "another node failed" if box.word(4) else None

    def scratch(self, dtype, count):
        """The data areas of the next two submissions, as arrays of `count` items: the leader
        reduces straight into them (no copy into the mailbox)."""
        return [self.box.data((self._next + k) % SLOTS)[:count * dtype.itemsize].view(dtype)
                for k in range(2)]

    def submit(self, fn, *args):
        box, k = self.box, self._next
        self._next = (k + 1) % SLOTS
        ctl, data = box.ctl(k), box.data(k)
        if box.word(ctl) == SUBMITTED:
            raise ShmtreeError("shmtree: the proxy's mailbox is full (a bug: at most two steps "
                               "may be in flight)")
        if box.word(4):
            raise PeerLostError(f"shmtree: {self.failure}")
        if fn is Link.allreduce:
            buf, op = args
            step, out, at = ALLREDUCE, buf, 0
            raw = buf.reshape(-1).view(np.uint8)
            box.put_text(ctl + 64, str(op), 32)
            box.put_text(ctl + 96, _dtype_key(buf.dtype), 32)
        elif fn is Link.bcast:
            buf, root = args
            step, out, at = BCAST, buf, 0
            raw = buf.reshape(-1).view(np.uint8)
            box.bytes[ctl + 12:ctl + 16].view(np.int32)[0] = root
        elif fn is Link.allgatherv:
            send, recv, counts = args
            step, out = ALLGATHERV, recv
            n = len(counts)
            need = 8 * n + send.size + recv.size
            if need > box.segment:
                raise ShmtreeError(f"shmtree: {need} bytes do not fit the mailbox's "
                                   f"{box.segment}")
            data[:8 * n].view(np.uint64)[:] = counts
            data[8 * n:8 * n + send.size] = send
            raw, at = None, 8 * n + send.size
            box.put_u64(ctl + 24, recv.size)
            box.put_u64(ctl + 16, send.size)
        elif fn is Proxy.split:
            keys, extra = args
            step, n = SPLIT, len(keys)
            extra = np.asarray(extra, np.int64)
            if 8 * (3 * n + extra.size) > box.segment:
                raise ShmtreeError(f"shmtree: a split of {n} communicators across nodes does "
                                   f"not fit the mailbox's {box.segment} bytes")
            out = np.zeros((n, 2), np.int64)
            data[:8 * n].view(np.int64)[:] = keys
            data[24 * n:24 * n + 8 * extra.size].view(np.int64)[:] = extra
            raw, at = None, 8 * n
            box.put_u64(ctl + 16, n)
            box.put_u64(ctl + 24, extra.size)
        elif fn is Link.exchange:
            send, recv = args
            step, out = EXCHANGE, recv
            n = len(send)
            ssz = [int(p.size) for p in send]
            rsz = [int(p.size) for p in recv]
            need = 16 * n + sum(ssz) + sum(rsz)
            if need > box.segment:
                raise ShmtreeError(f"shmtree: {need} bytes do not fit the mailbox's "
                                   f"{box.segment}")
            data[:8 * n].view(np.uint64)[:] = ssz
            data[8 * n:16 * n].view(np.uint64)[:] = rsz
            at = 16 * n
            for p in send:
                data[at:at + p.size] = p
                at += p.size
            raw = None
            box.put_u64(ctl + 24, sum(rsz))
            box.put_u64(ctl + 16, sum(ssz))
        else:
            raise ShmtreeError(f"shmtree: the proxy has no step {fn!r}")
        if raw is not None:
            if raw.size > box.segment:
                raise ShmtreeError(f"shmtree: a step of {raw.size} bytes does not fit the "
                                   f"mailbox's {box.segment}")
            if raw.size and raw.__array_interface__["data"][0] != \
                    data.__array_interface__["data"][0]:
                data[:raw.size] = raw
            box.put_u64(ctl + 16, raw.size)
        box.bytes[ctl + 8:ctl + 12].view(np.uint32)[0] = step
        box.set_word(ctl, SUBMITTED)
        return _Job(k, step, out, at)

    def wait(self, job, deadline=None):
        box = self.box
        ctl = box.ctl(job.slot)
        while True:
            state = box.wait_word(ctl, SUBMITTED, WAIT_SLICE_S)
            if state != SUBMITTED:
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise CollectiveTimeoutError(
                    "shmtree: timed out waiting for the other nodes (the launcher's inter-node "
                    "step did not complete)")
        if state == FAILED:
            raise PeerLostError(f"shmtree: {box.get_text(ctl + 1024) or self.failure}")
        data = box.data(job.slot)
        at = job.at
        if job.step == SPLIT:
            job.out[...] = data[at:at + job.out.nbytes].view(np.int64).reshape(job.out.shape)
            return job.out
        if job.step == EXCHANGE:           # (the receives follow the sends)
            for part in job.out:
                part[...] = data[at:at + part.size]
                at += part.size
            return job.out
        raw = job.out.reshape(-1).view(np.uint8)
        if raw.size and raw.__array_interface__["data"][0] != \
                data[at:].__array_interface__["data"][0]:
            raw[...] = data[at:at + raw.size]
        return job.out

    def run(self, fn, *args, deadline=None):
        return self.wait(self.submit(fn, *args), deadline)

    def abort(self, text):
        box = self.box
        if box.word(0):
            return
        box.put_text(64, text)
        box.set_word(0, 1)

    def close(self):
        if self._owned:
            self.box.set_word(8, 1)
