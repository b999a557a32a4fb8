"""The point-to-point calls of a communicator (the Messages mixin of Communicator): send, recv,
sendrecv, isend, irecv, their arguments checked, each routed to its transport."""
from __future__ import annotations

import operator
import os

import numpy as np

from .. import _p2p
from ..groups import session
from ..frontend.calls import deadline_of, movable
from ..frontend.requests import Request
from .messages import Transport
from .records import (ANY_SOURCE, ANY_TAG, Status, _Recv, _Send, _launcher_pid, _set_status,
                      _status_arg)


__all__ = ["Messages"]

def _rank_arg(comm, r, what, any_ok=False):
    """A rank argument checked: an int in 0..size-1, or (any_ok: a receive's source)
    ANY_SOURCE."""
    try:
        r = operator.index(r)
    except TypeError:
        raise TypeError(f"shmtree: {what} must be an int, got {type(r).__name__}") from None
    if not 0 <= r < comm.size:
        if r == ANY_SOURCE:
            if any_ok:
                return r
            raise ValueError(f"shmtree: {what} ANY_SOURCE ({ANY_SOURCE}) is for receives only: "
                             f"a message goes to a rank in 0..{comm.size - 1}")
        raise ValueError(f"shmtree: {what} {r} is outside 0..{comm.size - 1}")
    return r


def _tag_arg(tag, what="tag", any_ok=False):
    """A tag checked: an int >= 0, or (any_ok: a receive's) ANY_TAG."""
    try:
        tag = operator.index(tag)
    except TypeError:
        raise TypeError(f"shmtree: {what} must be an int >= 0, got {type(tag).__name__}") \
            from None
    if not 0 <= tag < 2**63:
        if tag == ANY_TAG:
            if any_ok:
                return tag
            raise ValueError(f"shmtree: {what} ANY_TAG ({ANY_TAG}) is for receives only: a "
                             "message's tag is an int >= 0")
        raise ValueError(f"shmtree: {what} must be an int >= 0, got {tag}")
    return tag


def _asked(source, tag):
    """(source, tag) as a receive named them, None for ANY_SOURCE / ANY_TAG (_Recv.asked)."""
    return (None if source == ANY_SOURCE else source, None if tag == ANY_TAG else tag)


def _out_arg(out):
    if out is None:
        return None
    if not isinstance(out, np.ndarray):
        raise TypeError(f"shmtree: recv: out must be a numpy array, got {type(out).__name__}")
    if not out.flags.writeable:
        raise ValueError("shmtree: recv: out is read-only")
    return out


# (Messages.send, recv, sendrecv)
_native_send, _native_recv = _p2p.messages_send, _p2p.messages_recv
_native_sendrecv = _p2p.messages_sendrecv
for _f, _name in ((_native_send, "send"), (_native_recv, "recv"),
                  (_native_sendrecv, "sendrecv")):
    _f.__name__, _f.__qualname__, _f.__module__ = _name, f"Messages.{_name}", __name__


class Messages:
    """Point-to-point messages of a communicator (docs/design.md, "How messages travel")."""

    _p2p_transport = None
    _p2p_quick = None           # the transport's Quick, once made, when _p2p_route is this
                                # class's (send and recv call it first: see send)

    def _p2p_nonce(self):
        """What names this communicator's channels: its group's nonce (a sub-communicator
        has a group, and so a nonce, of its own)."""
        return self.group._nonce

    def _p2p_pid(self, r):
        """The pid of rank r's process (0 while it has not joined): from its join record in
        the group's segment.  (A communicator whose ranks are not its group's overrides this
        and _p2p_nonce.)"""
        if r >= self.group.size:         # (inter=: the node's launcher, relaying between nodes)
            return _launcher_pid(self.group)
        joined, pid, _ = self.group._seg.member(r)
        return pid if joined else 0

    def _p2p_route(self, r, what, tag, tag_what="tag"):
        """(transport, rank in it, tag in it) that carry messages with `tag` to or from rank r
        (`what`, `tag_what` name them): here the one transport, r and tag as given (the native
        quick path checks what it takes, the calls check them otherwise).  (A communicator
        across nodes routes each peer, checked and translated: remote.SpanningMessages.)"""
        return self._p2p(), r, tag

    def _p2p(self):
        tr = self._p2p_transport
        if self._closed or self._gen != session._fork_gen or self.group._closed \
                or self.group.aborted():
            self._check_usable()      # (raises: closed, a forked child's, aborted)
        if tr is None:
            tr = self._p2p_transport = Transport(self)
            if type(self)._p2p_route is Messages._p2p_route:
                self._p2p_quick = tr.quick    # (routed across nodes: never, each call routes)
        return tr

    # A plain communicator's send, recv and sendrecv begin natively (_p2p.messages_send,
    # messages_recv, messages_sendrecv: the quick path first, with no Python-level check, as
    # it checks what _p2p does, Quick._usable, and declines, nothing done, whatever it does
    # not take), and come to these general paths, which raise what is wrong, when it declines.
    send = _native_send
    recv = _native_recv
    sendrecv = _native_sendrecv

    def _send_general(self, array, dest, tag, timeout, tried):
        """send, past the quick path (tried: already, by _p2p.messages_send)."""
        tr, dest, tag = self._p2p_route(dest, "dest", tag)
        if not tried and tr.quick.send(array, dest, tag):   # (described as one sent before)
            return None
        dest, tag, array = _rank_arg(self, dest, "dest"), _tag_arg(tag), movable(array, "send")
        if tr.quick_send(array, dest, tag):
            return None
        op = _Send(dest, tag, deadline_of(timeout), array, tr.cma)
        with tr.lock:
            tr.post_send(op)
        tr.run([op])
        if op.error is not None:
            raise op.error
        return None

    def _recv_general(self, source, tag, out, timeout, deadline, tried, status=None):
        """recv, past the quick path (tried: already, by _p2p.messages_recv, with the deadline
        given; else the deadline is timeout's, found here)."""
        asked = self._p2p_asked(source, tag)
        tr, source, tag = self._p2p_route(source, "source", tag)
        _status_arg(status)
        if not tried:
            deadline = deadline_of(timeout)
            got = tr.quick.recv(source, tag, out, deadline)      # (checks what it takes)
            if got is not None:
                if status is not None:
                    _set_status(status, asked[0], asked[1], got)
                return got
        source, tag = _rank_arg(self, source, "source", True), _tag_arg(tag, any_ok=True)
        op = _Recv(source, tag, deadline, _out_arg(out), asked)
        with tr.lock:
            tr.post_recv(op)
        tr.run([op])
        if op.error is not None:
            raise op.error
        if status is not None:
            op.status(status)
        return op.result

    def _p2p_asked(self, source, tag):
        """(_Recv.asked) A receive's source and tag as named, in this communicator's ranks and
        tags: None for ANY_SOURCE / ANY_TAG (then the message's, once matched), the rest
        checked (a communicator across nodes translates them for its transports)."""
        try:
            source, tag = operator.index(source), operator.index(tag)
        except TypeError:
            return (None, None)           # (the route's checks raise what is wrong)
        return _asked(source, tag)

    def _sendrecv_general(self, array, dest, source, sendtag, recvtag, out, timeout,
                          status=None):
        """sendrecv, past the quick path (_p2p.messages_sendrecv)."""
        asked = self._p2p_asked(source, recvtag)
        tr, dest, sendtag = self._p2p_route(dest, "dest", sendtag, "sendtag")
        from_tr, source, recvtag = self._p2p_route(source, "source", recvtag, "recvtag")
        deadline = deadline_of(timeout)
        dest, sendtag = _rank_arg(self, dest, "dest"), _tag_arg(sendtag, "sendtag")
        source = _rank_arg(self, source, "source", True)
        recvtag = _tag_arg(recvtag, "recvtag", True)
        array, out, status = movable(array, "send"), _out_arg(out), _status_arg(status)
        if from_tr is not tr:           # (across nodes: one peer on this node, one elsewhere)
            request = self._p2p_post(from_tr, _Recv(source, recvtag, deadline, out, asked),
                                     "irecv")
            op = _Send(dest, sendtag, deadline, array, tr.cma)
            with tr.lock:
                tr.post_send(op)
            tr.run([op])
            if op.error is not None:
                raise op.error
            got = request.result()
            if status is not None:
                for name in Status.__slots__:
                    setattr(status, name, getattr(request.status, name))
            return got
        if tr.quick_send(array, dest, sendtag):      # (a small message: sent already)
            got = tr.quick.recv(source, recvtag, out, deadline)
            if got is not None:
                if status is not None:
                    _set_status(status, asked[0], asked[1], got)
                return got
            ops = [_Recv(source, recvtag, deadline, out, asked)]
        else:
            ops = [_Send(dest, sendtag, deadline, array, tr.cma),
                   _Recv(source, recvtag, deadline, out, asked)]
        with tr.lock:
            for op in ops:
                (tr.post_send if op.kind == "send" else tr.post_recv)(op)
        tr.run(ops)
        for op in ops:
            if op.error is not None:
                raise op.error
        if status is not None:
            ops[-1].status(status)
        return ops[-1].result

    def isend(self, array, dest, *, tag=0, timeout=None):
        """send, nonblocking: a Request (the array must not be modified until it is done)."""
        tr, dest, tag = self._p2p_route(dest, "dest", tag)
        op = _Send(_rank_arg(self, dest, "dest"), _tag_arg(tag), deadline_of(timeout),
                   movable(array, "send"), tr.cma)
        return self._p2p_post(tr, op, "isend")

    def irecv(self, source, *, tag=0, out=None, timeout=None):
        """recv, nonblocking: a Request whose result is the received array, and whose
        `status` (a shmtree.Status) says the message's source, tag and size once it is done.
        source and tag may be ANY_SOURCE and ANY_TAG, as recv's."""
        asked = self._p2p_asked(source, tag)
        tr, source, tag = self._p2p_route(source, "source", tag)
        op = _Recv(_rank_arg(self, source, "source", True), _tag_arg(tag, any_ok=True),
                   deadline_of(timeout), _out_arg(out), asked)
        return self._p2p_post(tr, op, "irecv")

    def _p2p_post(self, tr, op, name):
        n = self._posted = self._posted + 1
        request = Request(name, n, tr)
        with tr.lock:
            if op.kind == "send":
                tr.post_send(op)
            else:
                tr.post_recv(op)
            tr.post_nonblocking(op, request)
        return request

    def _messages_drain(self):
        tr = self._p2p_transport
        if tr is not None and tr.pid == os.getpid() and tr.nonblocking:
            tr.drain_sends()

    def _messages_close(self):
        tr = self._p2p_transport
        if tr is not None and tr.pid == os.getpid():
            self._p2p_transport = self._p2p_quick = None
            tr.close()


_p2p.set_general(Messages._send_general, Messages._recv_general, Messages._sendrecv_general,
                 deadline_of, _set_status)
