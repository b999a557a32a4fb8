"""Security of the shared memory (docs/design.md, "Lifetime and security"; transport.py).

- the segment is a memfd: no entry in /dev/shm, /proc/<pid>/fd shows memfd:shmtree-..., the
  descriptor is close-on-exec (an exec'd program does not inherit it);
- a forked worker maps it (and a spawned one receives it by descriptor passing); an unrelated
  process finds no name to open (nothing in /dev/shm, nothing to shm_open) and an exec'd child
  inherits no descriptor.  That is all "no name" gives: any process of the same user (or root)
  CAN still open the segment through /proc/<member pid>/fd/<n> (ptrace-level access), and
  shmtree trusts same-user processes; only processes of other users are kept out, by the
  kernel's permission check on /proc/<pid>/fd, which these tests do not exercise;
- the attach check of a pickled Group (spawn / forkserver) refuses a wrong nonce, a wrong magic,
  a wrong size, a wrong group geometry with a clear ShmtreeError, and closes what it was given;
- a group larger than the free memory is refused up front (ShmtreeError naming the need and
  the free amount), not a SIGBUS later;
- the memfd is sealed against resizing (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL).

Private API used here, sparingly and on purpose: ``group._fd`` (the memfd, to inspect its
seals and /proc link and to corrupt its header through a second mapping) and
``shmtree.api._rebuild_group`` (what unpickling a Group runs in a spawned process), called with
tampered arguments because a real spawn cannot be made to carry them.
"""
import dataclasses
import errno
import fcntl
import mmap
import multiprocessing as mp
import os
import re
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import shmtree
import shmtree.machine.plan
from shmtree import api

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def shm_listing():
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


def open_fds():
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return out


class FakeDupFd:
    """Stands in for multiprocessing's DupFd in a pickled Group: detach() hands over a fd."""

    def __init__(self, fd):
        self.fd = fd

    def detach(self):
        return self.fd


def rebuild_args(group):
    """The arguments Group.__reduce__ would send to a spawned process (private layout)."""
    fn, args = group.__reduce__()
    assert fn is api._rebuild_group
    plan, dupfd, nonce, total = args
    os.close(dupfd.detach())       # take back the duplicate multiprocessing holds for a receiver
    return plan, nonce, total


# ---------------------------------------------------------------------------------------------
# a memfd, not a name

@pytest.mark.timeout(30)
def dev_shm_mappings():
    with open("/proc/self/maps") as f:
        return {line.split()[-2] if line.endswith("(deleted)\n") else line.split()[-1]
                for line in f if "/dev/shm" in line}


def test_segment_is_an_unnamed_memfd():
    before = shm_listing()
    mapped_before = dev_shm_mappings()    # multiprocessing's own heap arenas (pym-*) may be there
    with shmtree.Group(4) as g:
        assert shm_listing() == before, "the group created a /dev/shm entry"
        link = os.readlink(f"/proc/{os.getpid()}/fd/{g._fd}")
        assert re.fullmatch(r"/memfd:shmtree-\d+ \(deleted\)", link), link
        with open("/proc/self/maps") as f:
            maps = f.read().splitlines()
        shared = [line for line in maps if "memfd:shmtree" in line]
        assert shared and all(" rw-s " in line for line in shared), shared
        assert dev_shm_mappings() <= mapped_before, "the group mapped something from /dev/shm"
        flags = fcntl.fcntl(g._fd, fcntl.F_GETFD)
        assert flags & fcntl.FD_CLOEXEC, "the memfd would leak into exec'd programs"


UNRELATED = textwrap.dedent("""
    import os, sys
    names = [n for n in os.listdir("/dev/shm") if "shmtree" in n]
    inherited = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "memfd:shmtree" in os.readlink(f"/proc/self/fd/{fd}"):
                inherited.append(fd)
        except OSError:
            pass
    try:
        import _posixshmem
        _posixshmem.shm_open("/shmtree-" + sys.argv[1], os.O_RDWR, 0o600)
        opened = True
    except (OSError, ImportError):
        opened = False
    print(repr((names, inherited, opened)))
""")


@pytest.mark.timeout(30)
def test_unrelated_process_finds_no_name():
    """An unrelated process finds no /dev/shm name, inherits no descriptor through exec, and
    cannot shm_open the segment by a guessed name.  (It could still open it through
    /proc/<pid>/fd/<n> when it runs as the same user: shmtree trusts same-user processes.)"""
    with shmtree.Group(3) as g:
        out = subprocess.run([sys.executable, "-c", UNRELATED, str(os.getpid())],
                             capture_output=True, text=True, timeout=20, close_fds=False)
        assert out.returncode == 0, out.stderr
        names, inherited, opened = eval(out.stdout)
        assert g._fd >= 0
    assert names == [], f"/dev/shm names an unrelated process can see: {names}"
    assert inherited == [], "an exec'd child inherited the memfd (close_fds=False)"
    assert not opened, "shm_open by the name found the segment"


def forked_reader(comm):
    # the worker maps the same pages: what rank 0 contributes, rank 1 reads back reduced
    return comm.allreduce(np.arange(5.0) * (comm.rank + 1)).tolist()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_workers_map_it(method):
    assert shmtree.run(forked_reader, 2, start_method=method) == [[0.0, 3.0, 6.0, 9.0, 12.0]] * 2


# ---------------------------------------------------------------------------------------------
# the attach check of a pickled group

def tamper(case, group):
    """(plan, fd, nonce, total) with one thing wrong; fd is a fresh descriptor."""
    plan, nonce, total = rebuild_args(group)
    fd = os.dup(group._fd)
    if case == "nonce":
        nonce = bytes(b ^ 0xFF for b in nonce)
    elif case == "total":
        total = total + 4096
    elif case == "options":
        plan = dataclasses.replace(plan, chunk_bytes=plan.chunk_bytes * 2)
    elif case == "plan":                             # same geometry, another plan
        plan = dataclasses.replace(plan, spin_ns=plan.spin_ns + 1000)
    elif case == "size":
        plan = shmtree.machine.plan.plan_group(plan.size + 1, chunk_bytes=plan.chunk_bytes)
    elif case == "other_group":
        other = shmtree.Group(group.size, chunk_bytes=group.chunk_bytes)
        os.close(fd)
        fd = os.dup(other._fd)                       # same geometry, another group's segment
        other.close()
    elif case == "foreign_memfd":
        os.close(fd)
        fd = os.memfd_create("not-shmtree", os.MFD_CLOEXEC)
        os.ftruncate(fd, total)                      # right size, no header at all
    return plan, fd, nonce, total


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", ["nonce", "total", "options", "plan", "size", "other_group",
                                  "foreign_memfd"])
def test_attach_refuses_the_wrong_segment(case):
    with shmtree.Group(3, chunk_bytes=8192) as g:
        plan, fd, nonce, total = tamper(case, g)
        fds_before = set(open_fds())
        with pytest.raises(shmtree.ShmtreeError) as info:
            api._rebuild_group(plan, FakeDupFd(fd), nonce, total)   # private
        msg = str(info.value)
        assert "shmtree" in msg and re.search(r"size|nonce|magic|not this group", msg), msg
        if case == "plan":
            assert "plan digest" in msg, msg
        # the descriptor it was handed is closed, nothing else is left open
        assert fd not in open_fds() or "memfd" not in open_fds()[fd], "attach kept the fd"
        assert set(open_fds()) <= fds_before
        # the real group is untouched
        assert not g.aborted()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("field,offset,fmt", [("magic", 0, "<Q"), ("version", 8, "<I"),
                                              ("nranks", 12, "<I"), ("total", 16, "<Q"),
                                              ("plan digest", 48, "<Q")])
def test_attach_refuses_a_corrupted_header(field, offset, fmt):
    """Corrupt one header field through a second mapping of the memfd (private: the header
    layout of _engine.pyx), then attach as a spawned process would."""
    with shmtree.Group(2) as g:
        plan, nonce, total = rebuild_args(g)
        with mmap.mmap(g._fd, 4096) as m:
            (value,) = struct.unpack_from(fmt, m, offset)
            struct.pack_into(fmt, m, offset, value ^ 0x5A)
        with pytest.raises(shmtree.ShmtreeError, match="not this group's|bad magic"):
            api._rebuild_group(plan, FakeDupFd(os.dup(g._fd)), nonce, total)
        with mmap.mmap(g._fd, 4096) as m:                 # restore: the group works again
            struct.pack_into(fmt, m, offset, value)
        good = api._rebuild_group(plan, FakeDupFd(os.dup(g._fd)), nonce, total)
        assert isinstance(good, shmtree.Group) and good.size == 2
        good.close()


@pytest.mark.timeout(30)
def test_untampered_rebuild_attaches():
    """The control for the two tests above: the same path with the right arguments works."""
    with shmtree.Group(3, chunk_bytes=8192) as g:
        plan, nonce, total = rebuild_args(g)
        h = api._rebuild_group(plan, FakeDupFd(os.dup(g._fd)), nonce, total)
        try:
            assert h.layout.total == g.layout.total and h.size == 3
        finally:
            h.close()


@pytest.mark.timeout(30)
def test_closed_group_cannot_be_pickled():
    import pickle

    g = shmtree.Group(2)
    g.close()
    with pytest.raises(shmtree.ShmtreeError, match="closed"):
        pickle.dumps(g)


# ---------------------------------------------------------------------------------------------
# memory: refused up front, and sealed

@pytest.mark.timeout(30)
@pytest.mark.parametrize("kw", [dict(chunk_bytes=2 ** 40), dict(slots=2 ** 30),
                                dict(chunk_bytes=2 ** 36, slots=64)])
def test_group_larger_than_free_memory(kw):
    from shmtree.groups.transport import available_memory

    fds = set(open_fds())
    with pytest.raises(shmtree.ShmtreeError) as info:
        shmtree.Group(2, **kw)
    msg = str(info.value)
    m = re.search(r"needs ([\d.]+) MiB .* only ([\d.]+) MiB is free", msg)
    assert m, f"the message does not name the need and the free amount: {msg}"
    need, free = float(m.group(1)), float(m.group(2))
    assert need > free
    ring = kw.get("chunk_bytes", 128 * 1024) * kw.get("slots", 4)    # one ring's slots at least
    assert need * 2 ** 20 >= 0.99 * ring, f"the stated need is below one ring: {msg}"
    assert abs(free - available_memory() / 2 ** 20) < 0.25 * free + 64
    assert "chunk_bytes" in msg or "slots" in msg, f"not actionable: {msg}"
    assert set(open_fds()) <= fds, "a refused group left a descriptor open"


@pytest.mark.timeout(30)
def test_memfd_is_sealed():
    with shmtree.Group(2) as g:
        seals = fcntl.fcntl(g._fd, fcntl.F_GET_SEALS)
        assert seals & SEALS == SEALS, f"seals {seals:#x}"
        size = os.fstat(g._fd).st_size
        for new in (size + 4096, size // 2, 0):
            with pytest.raises(PermissionError) as info:
                os.ftruncate(g._fd, new)
            assert info.value.errno == errno.EPERM
        with pytest.raises(PermissionError):
            fcntl.fcntl(g._fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)   # sealed seals
        assert os.fstat(g._fd).st_size == size == g.layout.total


def child_resizes(group, queue):
    try:
        os.ftruncate(group._fd, 0)
        queue.put("resized")
    except OSError as e:
        queue.put(errno.errorcode.get(e.errno, str(e.errno)))


@pytest.mark.timeout(30)
def test_forked_member_cannot_resize():
    """A forked process holds the same descriptor; the seals bind it too."""
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    with shmtree.Group(2) as g:
        p = ctx.Process(target=child_resizes, args=(g, queue))
        p.start()
        try:
            result = queue.get()
        finally:
            p.join(10)
            if p.exitcode is None:
                p.kill()
                p.join(5)
    assert result == "EPERM", result


def test_rendezvous_token_attaches_and_refuses_what_it_cannot_open():
    import json
    g = shmtree.Group(2, pin=False)
    try:
        token = g.rendezvous_token()
        other = shmtree.Group.from_token(token)       # (through /proc/<pid>/fd: same user)
        try:
            assert other.plan == g.plan and other.size == 2
        finally:
            other.close()
        data = json.loads(token)                      # (plain data: see the test below)
        for change, what in (({"pid": 2 ** 22 + 7}, "cannot attach"),
                             ({"nonce": (b"x" * 16).hex()}, "nonce"),
                             ({"total": data["total"] + 4096}, "size")):
            with pytest.raises(shmtree.ShmtreeError, match=what):
                shmtree.Group.from_token(json.dumps(dict(data, **change)).encode())
    finally:
        g.close()


class _Payload:
    """A pickle that, when loaded, creates a file (stands for any code run by unpickling)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_rendezvous_token_is_parsed_never_executed(tmp_path):
    """The token travels through stores others may write (torch's TCP store): it is plain JSON,
    parsed and checked field by field; a pickle is refused without being loaded; a tampered
    plan is refused by the plan digest or its own checks."""
    import json
    import pickle
    marker = tmp_path / "ran"
    with pytest.raises(shmtree.ShmtreeError, match="not a valid rendezvous token"):
        shmtree.Group.from_token(pickle.dumps(_Payload(str(marker))))
    assert not marker.exists()
    g = shmtree.Group(2, pin=False)
    try:
        token = g.rendezvous_token()
        assert isinstance(token, bytes) and b"\x80" not in token     # (no pickle opcode)
        data = json.loads(token)
        bad_plan = dict(data["plan"])
        bad_plan["spin_ns"] += 1                      # another plan, the same layout
        cyclic = dict(data["plan"], small_tree=dict(data["plan"]["small_tree"], parent=[1, 0]))
        for bad, what in ((json.dumps(dict(data, plan=bad_plan)).encode(), "plan digest"),
                          (json.dumps(dict(data, plan=cyclic)).encode(),
                           "not a valid rendezvous token"),
                          (json.dumps(dict(data, pid=str(data["pid"]))).encode(),
                           r"not a valid rendezvous token \('pid' must be a process id"),
                          (json.dumps(dict(data, format="x")).encode(), "'format' must be"),
                          (json.dumps({k: v for k, v in data.items() if k != "plan"}).encode(),
                           "no 'plan'"),
                          (token[:-1], "it is not JSON"),
                          (b"[" * 100000, "not a valid rendezvous token"),
                          (5, "a token is bytes")):
            with pytest.raises(shmtree.ShmtreeError, match=what):
                shmtree.Group.from_token(bad)
    finally:
        g.close()


@pytest.mark.parametrize("options", [
    dict(size=2), dict(size=5, topology="2x2x4", tree=3, stall_timeout=2, numa="interleave"),
    dict(size=8, topology="2x4:2", tree="ring", placement="spread", small_bytes=0, nt_bytes=0,
         spin_us=1.5),
    dict(size=3, tree="chain", pin=False, chunk_bytes=4096, slots=1),
    dict(size=6, topology="xeon-2s-snc2"), dict(size=7, topology="epyc-2s-nps4")])
def test_the_rendezvous_token_carries_every_plan(options):
    """The plan goes through the token's JSON unchanged (the header's digest would refuse it)."""
    import json
    from shmtree.groups.token import _plan_from_data, _plan_to_data
    from shmtree.machine.plan import plan_group
    plan = plan_group(**options)
    again = _plan_from_data(json.loads(json.dumps(_plan_to_data(plan))))
    assert again == plan and again.digest() == plan.digest() and again.topology == plan.topology
