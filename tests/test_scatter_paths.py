"""scatter as one engine call (engine/scatter.pxi, issue 35): a first round in which every out=
claims its block, the data inline when it fits the round's room or by the exchange of the
root's blocks in the same call; the quick path (Communicator._quick), the parsed one
(Executors._scatter), the nonblocking and persistent forms all make that one call.  Checked
against numpy for many dtypes, sizes around the paths' limits, both axes, out= given, omitted
or strided, non-contiguous inputs, P = 1..8; mismatches said on every rank; a peer killed in a
large scatter."""
import os
import signal
import time

import numpy as np
import pytest

import shmtree
from procutil import new_shm_entries, run_ok, shm_listing

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:                       # pragma: no cover
    BF16 = None

# items per block: 0, 1, 7, around the inline room (4 KiB at P=2), around an exchange item's
# payload, 4099, and a multi-item exchange
SIZES = (0, 1, 7, 1023, 1025, 4099, 70001)
DTYPES = ["float32", "int8", "complex128", "bool", "float16",
          [("a", "<i4"), ("b", "<f8")]] + ([BF16] if BF16 is not None else [])


def _table(P, n, dt):
    """The root's (P, n) array: every item its own value (in dtype dt)."""
    dt = np.dtype(dt)
    v = np.arange(P * n, dtype=np.int64).reshape(P, n)
    if dt.fields is not None:
        t = np.zeros((P, n), dt)
        t["a"] = v
        t["b"] = v * 0.5
        return t
    if dt.kind == "b":
        return (v % 3 == 0)
    return v.astype(dt)


def scatter_worker(comm, dtypes, sizes):
    P, me = comm.size, comm.rank
    done = 0
    for dt in dtypes:
        for n in sizes:
            whole = _table(P, n, dt)
            a = whole if me == 0 else None
            want = whole[me]
            for rep in range(2):              # (the second call of a size may come inline)
                got = comm.scatter(a, 0)
                assert got.dtype == want.dtype and got.shape == want.shape, (dt, n, got.shape)
                assert got.tobytes() == want.tobytes(), (dt, n, rep)
                out = np.zeros(n, whole.dtype)
                assert comm.scatter(a, 0, out=out) is out
                assert out.tobytes() == want.tobytes(), (dt, n, rep, "out=")
            # a strided out=, a non-contiguous root input (every other column of a wider one)
            wide = np.repeat(whole, 2, axis=1) if me == 0 else None
            src = wide[:, ::2] if me == 0 else None
            strided = np.zeros(2 * n, whole.dtype)[::2]
            comm.scatter(src, 0, out=strided)
            assert strided.tobytes() == want.tobytes(), (dt, n, "strided")
            # axis=0: np.array_split's blocks of a length that P does not divide
            rows = np.arange(n * P + (P - 1) if n else 0).astype(np.int32).reshape(-1, 1)
            got = comm.scatter(rows if me == 0 else None, 0, axis=0)
            assert np.array_equal(got, np.array_split(rows, P, axis=0)[me]), (dt, n, "axis=0")
            done += 1
    # the other ways in: nonblocking, persistent, another root
    t = _table(P, 5, "float64")
    got = comm.iscatter(t if me == P - 1 else None, root=P - 1).wait()
    assert np.array_equal(got, t[me])
    out = np.empty(5)
    p = comm.scatter_init(t if me == 0 else None, 0, out=out)
    for _ in range(3):
        p()
        assert np.array_equal(out, t[me])
    return done


@pytest.mark.timeout(240)
@pytest.mark.parametrize("P", [1, 2, 3, 5])
def test_scatter_against_numpy(P):
    got = run_ok(scatter_worker, P, args=(DTYPES, SIZES))
    assert got == [len(DTYPES) * len(SIZES)] * P


@pytest.mark.timeout(240)
def test_scatter_against_numpy_at_8_ranks():
    run_ok(scatter_worker, 8, args=(["float32", "int8"], (0, 1, 7, 600, 4099)))


@pytest.mark.timeout(240)
def test_scatter_with_a_small_room_and_long_rounds():
    """small_bytes=64: nothing but the smallest calls travels inline, so the exchange in the
    call carries nearly every size; and a large one: most calls inline."""
    for small in (64, 1 << 16):
        run_ok(scatter_worker, 3, args=(["float32", "complex128"], (0, 1, 7, 4099)),
               small_bytes=small)


def mismatch_worker(comm, which):
    """One rank's scatter disagrees with the root's; every rank must raise
    CollectiveMismatchError, and the group go on."""
    P, me = comm.size, comm.rank
    dt = [("a", "<i4"), ("b", "<f8")] if which == "long" else np.float32
    table = np.zeros((P, 4), dt)
    a = table if me == 0 else None
    kw = {}
    if which == "axis":                    # rank 2 splits along axis 0, the others take rows
        kw = {"axis": 0} if me == 2 else {}
    elif which in ("shape", "long"):       # rank 1's out= is a block too long
        kw = {"out": np.zeros(5 if me == 1 else 4, dt)}
    elif which == "dtype":                 # rank 2's out= has another dtype
        kw = {"out": np.zeros(4, np.float64 if me == 2 else np.float32)}
    elif which == "root":                  # rank 1 names another root
        kw = {"root": 1 if me == 1 else 0}
        a = table if me in (0, 1) else None
    try:
        comm.scatter(a, **({"root": 0} | kw))
        got = "no error"
    except Exception as exc:
        got = f"{type(exc).__name__}: {exc}"
    y = comm.scatter(np.arange(P * 2.).reshape(P, 2) if me == 0 else None, 0)
    assert np.array_equal(y, [2. * me, 2. * me + 1]), y
    return got


@pytest.mark.timeout(60)
@pytest.mark.parametrize("which,bad", [("axis", 2), ("shape", 1), ("dtype", 2), ("root", 1),
                                       ("long", 1)])
def test_a_scatter_that_disagrees_raises_on_every_rank(which, bad):
    got = run_ok(mismatch_worker, 3, args=(which,))
    for rank, text in enumerate(got):
        assert text.startswith("CollectiveMismatchError"), (which, rank, got)
        assert "scatter" in text, (which, rank, text)
        if which in ("shape", "dtype", "long"):
            assert f"rank {bad} passed out= of shape" in text, (which, rank, text)


def killed_worker(comm):
    """Large scatters until rank 1 kills itself in one: every other rank raises
    PeerLostError."""
    P, me = comm.size, comm.rank
    t = np.ones((P, 1 << 20), np.float32) if me == 0 else None
    out = np.empty(1 << 20, np.float32)
    try:
        for i in range(200):
            if me == 1 and i == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            comm.scatter(t, 0, out=out, timeout=30)
    except shmtree.PeerLostError as exc:
        return f"PeerLostError: {exc}"
    return "no error"


@pytest.mark.timeout(90)
def test_a_peer_killed_in_a_large_scatter():
    before = shm_listing()
    t0 = time.monotonic()
    with pytest.raises(shmtree.WorkerError) as info:
        shmtree.run(killed_worker, 3)
    assert info.value.rank == 1 and "SIGKILL" in str(info.value), str(info.value)
    assert time.monotonic() - t0 < 30
    assert not new_shm_entries(before)
