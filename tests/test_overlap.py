"""Input and out= sharing memory (DESIGN sections 5, 6, 8): the very same array, or disjoint
memory, is used directly; any other overlap goes through a copy, and the result is what numpy
says, on every rank.

One sweep: every collective (allreduce, reduce, broadcast, allgather, reduce_scatter) x P in
{2, 3} x message sizes (a small inline message, an inline one over 16 KiB - the engine reduces
and copies out 16 KiB pieces - and one that does not travel inline) x offsets of out from the
input (the same array, partial overlaps either side, adjacent) x private or shared arrays x
blocking or nonblocking.  Every rank checks its own results against numpy (the inputs are a
function of case and rank) and returns what differed.
"""
import numpy as np
import pytest

from procutil import run_ok

SMALL_BYTES = 65536                     # as when ranks outnumber cores
SIZES = {"small": 125, "inline>16KiB": 6007, "large": 20011}      # int32 items
COLLECTIVES = ("allreduce", "reduce", "broadcast", "allgather", "reduce_scatter")


def values(case, rank, n):
    x = (np.arange(n, dtype=np.int64) * 2654435761 + case * 97 + rank * 1000003) % 40009
    return (x - 20000).astype(np.int32)


def block(n, P, r):
    lo = r * (n // P) + min(r, n % P)
    return lo, lo + n // P + (1 if r < n % P else 0)


def offsets(coll, n, P, r):
    """Where out begins, in items from the input's first item."""
    if coll == "allgather":              # out spans P * n items; out[r] is the input itself
        return (-r * n, 0, 1, -1, 10, -10, P * n, -n)
    if coll == "reduce_scatter":         # out is rank r's block
        lo, hi = block(n, P, r)
        return (lo, 0, 1, -1, 10, n, -(hi - lo))
    return (0, 1, -1, 10, -10, n // 2, -(n // 2), n, -n)


def expected(coll, case, n, P, r, root):
    if coll == "broadcast":
        return values(case, root, n)
    if coll == "allgather":
        return np.stack([values(case, q, n) for q in range(P)])
    total = np.sum(np.stack([values(case, q, n) for q in range(P)]), axis=0, dtype=np.int32)
    if coll == "reduce_scatter":
        lo, hi = block(n, P, r)
        return total[lo:hi]
    return total


def call(comm, coll, a, out, root, nonblocking):
    if coll == "allreduce":
        f, args = comm.iallreduce if nonblocking else comm.allreduce, (a,)
    elif coll == "reduce":
        f, args = comm.ireduce if nonblocking else comm.reduce, (a, "sum", root)
    elif coll == "broadcast":
        f, args = comm.ibroadcast if nonblocking else comm.broadcast, (a, root)
    elif coll == "allgather":
        f, args = comm.iallgather if nonblocking else comm.allgather, (a,)
    else:
        f, args = comm.ireduce_scatter if nonblocking else comm.reduce_scatter, (a,)
    got = f(*args, out=out)
    return got.wait(timeout=60) if nonblocking else got


def sweep(comm, colls, shared_modes):
    P, r = comm.size, comm.rank
    bad = []
    ran = 0
    case = 0
    for coll in colls:
        for name, n in SIZES.items():
            span = 3 * P * n + 64
            start = P * n + 32
            for shared in shared_modes:
                buf = comm.zeros(span, np.int32) if shared else np.zeros(span, np.int32)
                for nonblocking in (False, True):
                    for d in offsets(coll, n, P, r):
                        # every rank runs the same number of cases (offsets differ by rank only
                        # in value)
                        case += 1
                        root = case % P
                        # broadcast twice: after a broadcast of one item its first round
                        # has room for 64 bytes (the data follows in a round of its own), then
                        # room for its own size (the data comes inline in the first round)
                        for again in range(2 if coll == "broadcast" else 1):
                            if coll == "broadcast" and again == 0:
                                comm.broadcast(np.zeros(1, np.int8), 0)
                            buf[...] = -7
                            a = buf[start:start + n]
                            a[...] = values(case, r, n)
                            m = {"allgather": P * n,
                                 "reduce_scatter": np.subtract(*block(n, P, r)[::-1])}.get(
                                     coll, n)
                            out = buf[start + d:start + d + m]
                            if coll == "allgather":
                                out = out.reshape(P, n)
                            got = call(comm, coll, a, out, root, nonblocking)
                            ran += 1
                            what = (coll, name, "shared" if shared else "private",
                                    "nonblocking" if nonblocking else "blocking", f"offset {d}",
                                    again)
                            if coll == "reduce" and r != root:
                                if got is not None:
                                    bad.append(what + ("returned something off the root",))
                                continue
                            if got is not out:
                                bad.append(what + ("did not return out",))
                                continue
                            want = expected(coll, case, n, P, r, root)
                            if not np.array_equal(out, want):
                                wrong = np.flatnonzero(out.reshape(-1) != want.reshape(-1))
                                bad.append(what + (f"{wrong.size} items wrong, first at "
                                                   f"{wrong[0]}",))
                del buf
    comm.barrier()
    return ran, bad


@pytest.mark.timeout(600)
@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("coll", COLLECTIVES)
def test_overlapping_out_every_collective(P, coll):
    results = run_ok(sweep, P, args=((coll,), (False, True)), small_bytes=SMALL_BYTES)
    for r, (ran, bad) in enumerate(results):
        assert ran > 0
        assert not bad, f"rank {r}: {len(bad)} of {ran} calls wrong: {bad[:12]}"


def test_the_rule_in_one_place():
    """_engine.clash, the rule the Python layers ask (the engine's begin, begin_coll and fast
    paths apply its C form): True only for memory shared without being the very same."""
    from shmtree import _engine
    b = np.arange(100.0)
    assert not _engine.clash(b[0:10], b[0:10])                  # the very same: in place
    assert not _engine.clash(b[0:12].reshape(3, 4), b[0:12])    # the same bytes, other shape
    assert not _engine.clash(b[0:10], b[10:20])                 # adjacent: disjoint
    assert not _engine.clash(b[::2], b[::2])                    # the same strided elements
    assert not _engine.clash(b[:0], b)                          # nothing to share
    assert _engine.clash(b[0:10], b[1:11])
    assert _engine.clash(b[10:20], b[0:11])
    assert _engine.clash(b[0:10], b[5:6])
    assert _engine.clash(b[::2], b[1::2])                       # (interleaved: by extents)
    assert _engine.clash(b[::-1], b)
