"""alltoall(counts=) as one engine call (engine/msg.pxi, msg_alltoallv; the counts round of
engine/alg_exchange.pxi): every rank's counts travel in the call's first round, small calls end
with it (their data inline), larger ones run the exchange on the byte matrix in the same call.

Against numpy: P = 1..6, counts with zeros, every dtype plain alltoall moves, row counts 0, 1,
7, 4099 and around the round's room, non-contiguous inputs and outputs, out= given or not, the
plain call, the parsed one, ialltoall and alltoall_init; one engine call each (the counts no
longer take a round of their own); mismatches said on every rank, the group usable after;
a group too large for the counts to fit the first round (the counts round kept) still right.
Every rank's input is rebuilt here from (case, rank), so the expected values are numpy's."""
import numpy as np
import pytest

import shmtree
from procutil import run_ok
from test_collectives import make, same_bytes, unwire, wire

try:
    import ml_dtypes
except ImportError:                       # pragma: no cover
    ml_dtypes = None

DTYPES = ["bool", "int8", "uint16", ">i4", "int64", "float16", "float32", ">f8", "longdouble",
          "complex64", "complex128", "S3", "U2", [("a", "<i2"), ("b", ">f8")],
          "datetime64[ns]"] + (["bfloat16"] if ml_dtypes else [])
ROWS = (0, 1, 7, 4099)
FORMS = ("plain", "out", "strided", "strided_out", "array_counts", "i", "init", "init_out")


def dt(name):
    return np.dtype(getattr(ml_dtypes, name)) if name == "bfloat16" else np.dtype(name)


def counts_of(P, r, n, seed):
    """Rank r's counts: n rows in all, split unevenly with zeros (a rank's own among them)."""
    w = [(r * 7 + q * 3 + seed) % 4 * (q != (r + seed) % P or P == 1) for q in range(P)]
    if not any(w):
        w[r % P] = 1
    counts = [n * x // sum(w) for x in w]
    counts[w.index(max(w))] += n - sum(counts)
    return counts


def rows_of(dtype, rest, n, r, seed):
    """Rank r's input: n rows of shape rest (bfloat16: float32 values rounded)."""
    k = n * int(np.prod(rest, dtype=np.int64))
    flat = (make("float32", None, k, r, seed).astype(dt("bfloat16")) if dtype == "bfloat16"
            else make(dtype, None, k, r, seed))
    return flat.reshape((n,) + rest)


def halves(P, r, n, seed=None):
    """Rank r's counts: half its n rows to the next rank, the rest to itself."""
    counts = [0] * P
    counts[r] += n // 2
    counts[(r + 1) % P] += n - n // 2
    return counts


def expected(P, rank, dtype, rest, n_of, seed, counts_of=counts_of):
    parts = []
    for s in range(P):
        counts = counts_of(P, s, n_of(s), seed)
        x = rows_of(dtype, rest, n_of(s), s, seed)
        lo = sum(counts[:rank])
        parts.append(x[lo:lo + counts[rank]])
    return np.concatenate(parts).astype(parts[0].dtype)       # (numpy's makes it native)


def strided(x):
    """x's values in a non-contiguous view (every other row of a copy twice as long)."""
    return np.repeat(x, 2, axis=0)[::2] if x.shape[0] else x[:, None][:, 0]


def one_call(comm, x, counts, form, n_in):
    """alltoall(x, counts=counts) made in `form`; (result, engine calls it took)."""
    before = comm.stats()["calls"]
    rest = x.shape[1:]
    if form == "plain":
        got = comm.alltoall(x, counts=counts)
    elif form == "out":
        out = np.full((n_in,) + rest, 0, x.dtype)
        got = comm.alltoall(x, counts=counts, out=out)
        assert got is out
    elif form == "strided":
        got = comm.alltoall(strided(x), counts=counts)
    elif form == "strided_out":             # out= not C-contiguous: filled after the call
        base = np.zeros((n_in, 2) + rest, x.dtype)
        out = base[:, 1]
        assert n_in < 2 or not out.flags.c_contiguous
        got = comm.alltoall(x, counts=counts, out=out)
        assert got is out
    elif form == "array_counts":
        got = comm.alltoall(x, counts=np.array(counts, np.int64))
    elif form == "i":
        got = comm.ialltoall(x, counts=counts).wait(60)
    else:                                   # init, init_out: bound once, called twice
        out = np.zeros((n_in,) + rest, x.dtype) if form == "init_out" else None
        p = comm.alltoall_init(x, counts=counts, out=out)
        first = p()
        before = comm.stats()["calls"]      # (the second call: the bound one)
        got = p()
        assert got is first and (out is None or got is out)
    return got, comm.stats()["calls"] - before


def worker(comm, cases):
    P, r = comm.size, comm.rank
    res = []
    for seed, (dtype, rest, n, form) in enumerate(cases):
        counts = counts_of(P, r, n, seed)
        n_in = sum(counts_of(P, s, n, seed)[r] for s in range(P))
        x = rows_of(dtype, rest, n, r, seed)
        got, ncalls = one_call(comm, x, counts, form, n_in)
        res.append((wire(got), ncalls))
    return res


def cases_for(P):
    cases = [(d, (3,), n, "plain") for d in DTYPES for n in ROWS]
    cases += [("float32", rest, n, form) for form in FORMS for n in ROWS
              for rest in [(), (2, 3)]]
    return cases


@pytest.mark.timeout(600)
@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 6])
def test_alltoallv_against_numpy(P):
    """Every dtype, rows 0 / 1 / 7 / 4099 split with zeros, each form; each call one engine
    call (the counts in its first round)."""
    cases = cases_for(P)
    outs = run_ok(worker, P, args=(cases,), chunk_bytes=4096)
    for k, (dtype, rest, n, form) in enumerate(cases):
        for rank in range(P):
            raw, ncalls = outs[rank][k]
            got = unwire(raw)
            want = expected(P, rank, dtype, rest, lambda s: n, k)
            assert got.dtype == want.dtype and got.shape == want.shape, \
                (dtype, rest, n, form, rank, got.dtype, got.shape, want.shape)
            assert same_bytes(got, want), (dtype, rest, n, form, rank)
            assert ncalls == 1, (dtype, rest, n, form, rank, ncalls)


def room_worker(comm, sizes):
    """Calls of each size in turn, three times each (the round's room follows the sizes):
    per call the result, the engine calls and the bytes this rank published."""
    P, r = comm.size, comm.rank
    res = []
    for n in sizes:
        for again in range(3):
            counts = halves(P, r, n)
            x = rows_of("float64", (), n, r, n)
            s0 = comm.stats()
            got = comm.alltoall(x, counts=counts)
            s1 = comm.stats()
            res.append((n, wire(got), s1["calls"] - s0["calls"],
                        s1["bytes_sent"] - s0["bytes_sent"]))
    return res


@pytest.mark.timeout(300)
@pytest.mark.parametrize("P", [2, 3, 5])
def test_sizes_around_the_round_room(P):
    """Row counts (8 bytes each) around the largest room a round may have (the inline limit
    over P, in whole 64-byte lines) and around the room each call leaves the next, in a loop
    that changes size: right every time, one engine call each."""
    cap = 4096 // P // 64 * 64 // 8                     # (rows: small_bytes 4096)
    sizes = [0, 3, cap - 1, cap, cap + 1, 5, 7, 2 * cap, 1, 64 // 8 * P + 1, 4099]
    outs = run_ok(room_worker, P, args=(sizes,), small_bytes=4096, chunk_bytes=4096)
    for rank in range(P):
        for n, raw, ncalls, _ in outs[rank]:
            want = expected(P, rank, "float64", (), lambda s: n, n, halves)
            got = unwire(raw)
            assert got.shape == want.shape and same_bytes(got, want), (n, rank)
            assert ncalls == 1, (n, rank, ncalls)


def inline_worker(comm, n_loop):
    """bytes_sent of: an empty call, a call of 3 rows to the next rank, again, then three
    calls of a loop of n_loop rows to it, and one of 12800 rows (100 KiB)."""
    P, r = comm.size, comm.rank
    res = []
    for n in (0, 3, 3, n_loop, n_loop, n_loop, 12800):
        x = np.full(n, r, np.float64)
        counts = [0] * P
        counts[(r + 1) % P] = n
        before = comm.stats()["bytes_sent"]
        got = comm.alltoall(x, counts=counts)
        res.append(comm.stats()["bytes_sent"] - before)
        assert np.array_equal(got, np.full(n, (r - 1) % P, np.float64))
    return res


@pytest.mark.timeout(60)
@pytest.mark.parametrize("P, n_loop", [(2, 128), (3, 168)])
def test_small_calls_are_one_round_with_their_data(P, n_loop):
    """A small call publishes its first round alone (the round's chunk, once per ring this rank
    sends it on), no more than an empty call; the round's room follows the calls, so the second
    and third of a loop of n_loop rows (1 KiB at P = 2; at P = 3 1344 bytes, the largest room
    there: 4096 / 3 in whole lines) publish whole rounds of 8 P (P + 2) bytes of rows and P
    rooms (the power of two that holds the rows, or the largest room); a 100 KiB call runs
    the exchange after its round."""
    room = min(1 << (n_loop * 8 - 1).bit_length(), 4096 // P // 64 * 64)
    first = 8 * P * (P + 2) + P * room
    for sent in run_ok(inline_worker, P, args=(n_loop,), small_bytes=4096):
        empty, small, again, _, loop, loop_again, large = sent
        assert small == again == empty, sent
        assert loop == loop_again and loop % first == 0, (sent, first)
        assert large > 100 * 1024, sent


def mismatch_worker(comm, case):
    """One alltoall(counts=) where ranks disagree, made by the quick path on rank 0, the parsed
    one (a strided input) on rank 1 and ialltoall on rank 2; then the group goes on."""
    P, r = comm.size, comm.rank
    x = np.zeros((P, 2 + (case == "rest" and r == 1)), "f4" if case != "dtype" or r else "i4")
    out = np.zeros((P + (case == "out" and r == 2), x.shape[1]), x.dtype)
    if r == 1:
        x = strided(x)
    try:
        if r == 2:
            comm.ialltoall(x, counts=[1] * P, out=out).wait(60)
        else:
            comm.alltoall(x, counts=[1] * P, out=out if case == "out" else None)
        said = None
    except Exception as exc:
        said = f"{type(exc).__name__}: {exc}"
    ok = comm.alltoall(np.arange(P, dtype=np.int32), counts=[1] * P)
    return said, ok.tolist()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case, words", [("rest", ["(3, 2)", "(3, 3)"]),
                                         ("dtype", ["float32", "int32"]),
                                         ("out", ["out has 4 rows", "receives 3"])])
def test_mismatch_on_every_rank_whatever_the_path(case, words):
    outs = run_ok(mismatch_worker, 3, args=(case,), stall_timeout=None)
    for rank, (said, ok) in enumerate(outs):
        assert said is not None and said.startswith("CollectiveMismatchError"), (rank, said)
        for word in words:
            assert word in said, (rank, word, said)
        if case == "out" and rank != 2:
            assert "rank 2" in said, said
        assert ok == [rank] * 3


def fallback_worker(comm, n):
    """A group whose counts rows do not fit one chunk of the first round (small_bytes=64 at
    P = 5): the counts round, then the exchange; and a mismatch said on every rank there."""
    P, r = comm.size, comm.rank
    counts = counts_of(P, r, n, 1)
    before = comm.stats()["calls"]
    got = comm.alltoall(rows_of("int32", (2,), n, r, 1), counts=counts)
    ncalls = comm.stats()["calls"] - before
    try:
        comm.alltoall(np.zeros((P, 1 + (r == P - 1))), counts=[1] * P)
        said = None
    except shmtree.CollectiveMismatchError as exc:
        said = str(exc)
    return wire(got), ncalls, shmtree._engine.counts_in_round(comm._engine), said


@pytest.mark.timeout(120)
@pytest.mark.parametrize("P, small, travels", [(5, 64, False), (3, 64, True)])
def test_groups_whose_round_cannot_hold_the_counts_or_the_data(P, small, travels):
    """small_bytes=64: at P = 5 the rows do not fit the round (the counts round kept: two
    engine calls); at P = 3 they do, with no room for data (every call runs the exchange)."""
    outs = run_ok(fallback_worker, P, args=(40,), small_bytes=small, chunk_bytes=4096)
    for rank, (raw, ncalls, in_round, said) in enumerate(outs):
        want = expected(P, rank, "int32", (2,), lambda s: 40, 1)
        got = unwire(raw)
        assert got.shape == want.shape and same_bytes(got, want), rank
        assert in_round == travels and ncalls == (1 if travels else 2), (rank, ncalls)
        assert said is not None and f"({P}, 1)" in said and f"({P}, 2)" in said, said
