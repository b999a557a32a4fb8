"""Persistent collectives (DESIGN section 11): comm.*_init returns a shmtree.Persistent bound
once; p() runs it and returns the same output array every time (out=, or one made at init, or
- where the peers say the shape - the first call's), p.start() posts it, p.free() releases it.
Against the plain calls, mixed with them and with nonblocking calls in issue order."""
import os
import pickle
import time

import numpy as np
import pytest

import shmtree
from procutil import run_ok


def inits(comm, x, step):
    """Every collective's persistent form, and the plain call it stands for (on the same,
    bound, arrays), by name."""
    P, r = comm.size, comm.rank
    rows = x[:P]                                            # (P, n)
    counts = [(r + q) % 2 for q in range(P)]
    sent = x[:sum(counts)]
    root = (step + 1) % P
    return {
        "allreduce": (comm.allreduce_init(x, op="max"), lambda: comm.allreduce(x, op="max")),
        "broadcast": (comm.broadcast_init(x if r == root else None, root=root),
                      lambda: comm.broadcast(x if r == root else None, root=root)),
        "reduce": (comm.reduce_init(x, root=root), lambda: comm.reduce(x, root=root)),
        "allgather": (comm.allgather_init(x[0]), lambda: comm.allgather(x[0])),
        "allgather0": (comm.allgather_init(x[:r + 1], axis=0),
                       lambda: comm.allgather(x[:r + 1], axis=0)),
        "reduce_scatter": (comm.reduce_scatter_init(x), lambda: comm.reduce_scatter(x)),
        "alltoall": (comm.alltoall_init(rows), lambda: comm.alltoall(rows)),
        "alltoallv": (comm.alltoall_init(sent, counts=counts),
                      lambda: comm.alltoall(sent, counts=counts)),
        "gather": (comm.gather_init(x[0], root=root), lambda: comm.gather(x[0], root=root)),
        "gather0": (comm.gather_init(x[:r], root=root, axis=0),
                    lambda: comm.gather(x[:r], root=root, axis=0)),
        "scatter": (comm.scatter_init(rows if r == root else None, root=root),
                    lambda: comm.scatter(rows if r == root else None, root=root)),
        "scatter0": (comm.scatter_init(x if r == root else None, root=root, axis=0),
                     lambda: comm.scatter(x if r == root else None, root=root, axis=0)),
        "scan": (comm.scan_init(x), lambda: comm.scan(x)),
        "exscan": (comm.exscan_init(x, op="prod"), lambda: comm.exscan(x, op="prod")),
        "barrier": (comm.barrier_init(), lambda: comm.barrier()),
    }


def every_form_worker(comm, n):
    P, r = comm.size, comm.rank
    bad = []
    for step in range(2):
        x = np.zeros((max(P, 3), n))
        table = inits(comm, x, step)
        firsts = {}
        for call in range(3):
            x[...] = np.arange(x.size).reshape(x.shape) * (r + 1) + call   # contents change
            for name, (p, plain) in table.items():
                got = p()
                want = plain()
                if (got is None) != (want is None) or (
                        got is not None and not np.array_equal(got, want)):
                    bad.append((step, call, name, "value"))
                if call == 0:
                    firsts[name] = got
                elif got is not firsts[name]:
                    bad.append((step, call, name, "not the same array"))
            for name, (p, plain) in table.items():           # posted: the same results
                req = p.start()
                got = req.wait(60)
                want = plain()
                if (got is None) != (want is None) or (
                        got is not None and not np.array_equal(got, want)):
                    bad.append((step, call, name, "start"))
        for p, _ in table.values():
            p.free()
    return bad


@pytest.mark.timeout(120)
@pytest.mark.parametrize("P,n", [(1, 5), (2, 5), (3, 5), (3, 2000)])
def test_every_persistent_form_against_the_plain_call(P, n):
    outs = run_ok(every_form_worker, P, args=(n,), chunk_bytes=4096)
    assert outs == [[]] * P


def out_worker(comm):
    P, r = comm.size, comm.rank
    x = np.arange(6.0) + r
    o = np.empty(6)
    p = comm.allreduce_init(x, out=o)
    q = comm.allreduce_init(x, out=x)                  # in place
    s = comm.scan_init(x[::2])                         # strided input: the general path
    res = [p() is o, o.tolist()]
    res += [q() is x, x.tolist()]
    first = s()
    res += [s() is first, first.tolist()]
    o2 = np.empty(6)
    g = comm.allreduce_init(np.arange(6.0)[::-1].copy(), out=o2[::1])
    res.append(g() is not None)
    return res


@pytest.mark.timeout(60)
def test_out_and_in_place():
    outs = run_ok(out_worker, 2)
    assert outs[0][0] and outs[0][1] == [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]
    assert outs[1][2] and outs[1][3] == [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]
    # the scan of x[::2] after x was summed in place: rank 0 has [1, 5, 9] + ... (scan twice)
    assert outs[0][4]


def order_worker(comm):
    """Persistent calls, plain calls and nonblocking calls in issue order."""
    P, r = comm.size, comm.rank
    x = np.full(4, r + 1.0)
    p = comm.allreduce_init(x)
    q = comm.scan_init(x)
    reqs = [comm.iallreduce(x * 2), p.start(), comm.iscan(x)]
    a = p()                     # queued behind the outstanding calls: the slow path
    b = comm.alltoall(np.full((P, 1), float(r)))
    c = q()
    d = shmtree.wait_all(reqs, timeout=60)
    e = p()                     # nothing outstanding: the bound engine call
    return [v.tolist() for v in (d[0], d[1], d[2], a, b, c, e)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("P", [2, 3])
def test_issue_order_with_plain_and_nonblocking_calls(P):
    outs = run_ok(order_worker, P)
    total = sum(range(1, P + 1))
    for r, (d0, d1, d2, a, b, c, e) in enumerate(outs):
        assert d0 == [2.0 * total] * 4 and d1 == [1.0 * total] * 4 and a == [1.0 * total] * 4
        assert e == [1.0 * total] * 4
        assert d2 == [float(sum(range(1, r + 2)))] * 4 and c == d2
        assert b == [[float(s)] for s in range(P)]


def life_worker(comm):
    P, r = comm.size, comm.rank
    x = np.ones(3)
    p = comm.allreduce_init(x)
    out = [repr(p), isinstance(p, shmtree.Persistent)]
    try:
        pickle.dumps(p)
    except TypeError:
        out.append("no pickle")
    p.free()
    out.append(repr(p))
    for fn in (p, p.start):
        try:
            fn()
        except shmtree.ShmtreeError as exc:
            out.append(str(exc))
    # a timeout counts from each call, not from init
    t = comm.allreduce_init(x, timeout=0.5)
    u = comm.scan_init(x, timeout=0.5)             # (made of engine calls: the general path)
    for _ in range(3):                             # rank 0 waits in each call for rank 1
        time.sleep(0.3 if r else 0.05)
        t()
        time.sleep(0.3 if r else 0.05)
        u()
    # module level
    m = shmtree.scan_init(x)
    out.append(m().tolist())
    # mismatch: a persistent call against another call, on every rank, then usable
    bad = comm.scan_init(x) if r == 0 else comm.allreduce_init(x)
    try:
        bad()
    except shmtree.CollectiveMismatchError as exc:
        out.append("mismatch" if "scan" in str(exc) and "allreduce" in str(exc) else str(exc))
    out.append(comm.allreduce_init(x)().tolist())
    # a forked child cannot use them (bound with and without a timeout: two paths)
    plain = comm.allreduce_init(x)
    said = []
    for bound in (t, plain):
        rd, wr = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                bound()
                os.write(wr, b"ran")
            except shmtree.ShmtreeError:
                os.write(wr, b"refused")
            except BaseException:
                os.write(wr, b"other")
            os._exit(0)
        os.waitpid(pid, 0)
        said.append(os.read(rd, 16).decode())
        os.close(rd)
        os.close(wr)
    out.append(said)
    # closed: refused
    comm.close()
    try:
        t()
    except shmtree.ShmtreeError as exc:
        out.append("closed" if "communicator is closed" in str(exc) else str(exc))
    return out


@pytest.mark.timeout(60)
def test_lifetime_free_timeout_mismatch_fork_close():
    outs = run_ok(life_worker, 2, stall_timeout=None)
    for r, out in enumerate(outs):
        assert out[0] == "<shmtree.Persistent allreduce bound>" and out[1] is True
        assert out[2] == "no pickle" and out[3] == "<shmtree.Persistent allreduce freed>"
        assert "freed" in out[4] and "freed" in out[5]
        assert out[6] == [float(r + 1)] * 3
        assert out[7] == "mismatch"
        assert out[8] == [2.0] * 3
        assert out[9] == ["refused", "refused"]
        assert out[10] == "closed"


def torch_worker(comm):
    import torch
    t = torch.ones(3) * (comm.rank + 1)
    p = comm.allreduce_init(t)
    a, b = p(), p()
    o = torch.empty(3)
    q = comm.scan_init(t, out=o)
    return type(a).__name__, a is b, a.tolist(), q() is o, o.tolist()


@pytest.mark.timeout(60)
def test_torch_tensors():
    pytest.importorskip("torch")
    outs = run_ok(torch_worker, 2)
    assert outs[1] == ("Tensor", True, [3.0] * 3, True, [3.0] * 3)
