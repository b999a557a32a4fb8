"""Reproducible sums (issue 37; docs/design.md, "Reproducible sums").

- deterministic=True (allreduce, reduce, reduce_scatter, scan, exscan; blocking, i and _init
  forms) against the rank-order left fold, for every dtype and op, on every path the call
  takes (the engine's own call where it folds so, one allgather and a local fold, the
  transpose), on trees, schedules and synthetic topologies, on sub-communicators whose ranks
  are shuffled;
- shmtree.Accumulator: the same bits for P = 1..6 and random partitions of the same terms, in
  any order, on any tree, topology and rank order; against math.fsum with adversarial terms
  (cancellations, 1e308 with 1e-308, signed zeros, inf, NaN); float32, float16, bfloat16 and
  complex against the exactly rounded sum;
- a distributed conjugate gradient whose residual history is the same bits at P = 1, 2, 3, 4;
- ranks that disagree (deterministic=True on one rank only, an Accumulator of another dtype)
  raise CollectiveMismatchError on every rank, and the group stays usable; local errors;
- across simulated nodes (from_mpi): tests/mpi_repro_prog.py under mpiexec.

Inputs are rebuilt in the parent from (case, rank) seeds; workers return digests of their
results, which the parent compares with the digests of the expected arrays.
"""
import fractions
import hashlib
import math
import os
import pickle
import zlib

import numpy as np
import pytest

import shmtree
from shmtree import Accumulator
from procutil import run_ok

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:                 # pragma: no cover
    ml_dtypes = BF16 = None

F = fractions.Fraction
INT_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
FLOAT_DTYPES = ["float16", "float32", "float64", "complex64", "complex128"] + \
    (["bfloat16"] if BF16 is not None else [])
UFUNCS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
          "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}


def _dt(name):
    return BF16 if name == "bfloat16" else np.dtype(name)


def _ops(dtype):
    dt = _dt(dtype)
    if dt.kind == "c":
        return ["sum", "prod"]
    if dt.kind == "f" or dt.name == "bfloat16":
        return ["sum", "prod", "min", "max"]
    return ["sum", "prod", "min", "max", "band", "bor", "bxor"]


def _rng(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def det_input(dtype, op, shape, rank, seed=0):
    """Rank `rank`'s input: varied magnitudes (so that the order of a float sum shows in its
    bits), products near 1, integers over their whole range; no NaN, no signed-zero ties."""
    dt = _dt(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    rng = _rng(dtype, op, tuple(shape), rank, seed)
    if dt.kind == "b":
        a = rng.random(n) < 0.5
    elif dt.kind in "iu":
        info = np.iinfo(dt)
        a = rng.integers(-3, 4, n) if op == "prod" else \
            rng.integers(info.min, info.max, size=n, dtype=dt, endpoint=True)
    else:
        def real():
            if op == "prod":
                return rng.uniform(0.5, 1.5, n) * rng.choice([-1.0, 1.0], n)
            return rng.normal(size=n) * 10.0 ** rng.integers(-3, 4, n)
        a = real() + 1j * real() if dt.kind == "c" else real()
    return np.asarray(a).astype(dt).reshape(shape)


def left_fold(dtype, op, inputs):
    """The rank-order fold deterministic=True promises (docs/design.md, "Reproducible sums"):
    numpy's row-by-row fold of the stack; float16 and bfloat16 widened to float32, folded
    there and rounded once; complex products by the textbook formula, each part one rounded
    real op."""
    dt = _dt(dtype)
    ufunc = UFUNCS[op]
    rows = [np.asarray(x) for x in inputs]
    if dt.name in ("float16", "bfloat16"):
        rows = [r.astype(np.float32) for r in rows]
    acc = rows[0].copy()
    for r in rows[1:]:
        if dt.kind == "c" and op == "prod":
            ar, ai, br, bi = acc.real, acc.imag, r.real, r.imag
            re = np.subtract(np.multiply(ar, br), np.multiply(ai, bi))
            im = np.add(np.multiply(ar, bi), np.multiply(ai, br))
            acc = (re + 1j * im).astype(dt)
        else:
            acc = ufunc(acc, r, dtype=acc.dtype)
    return acc.astype(dt)


def digest(y):
    if y is None:
        return None
    y = np.asarray(y)
    h = hashlib.sha256(f"{y.dtype.str}{y.shape}".encode())
    h.update(np.ascontiguousarray(y).tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# deterministic=True against the left fold

FORMS = ("allreduce", "iallreduce", "allreduce_init", "reduce", "ireduce", "reduce_init",
         "reduce_scatter", "ireduce_scatter", "reduce_scatter_init", "module")


def det_call(comm, form, x, op, root):
    if form == "allreduce":
        return comm.allreduce(x, op, deterministic=True)
    if form == "iallreduce":
        return comm.iallreduce(x, op, deterministic=True).wait()
    if form == "allreduce_init":
        p = comm.allreduce_init(x, op, deterministic=True)
        p()
        return p().copy()
    if form == "module":
        return shmtree.allreduce(x, op, deterministic=True)
    if form == "reduce":
        return comm.reduce(x, op, root=root, deterministic=True)
    if form == "ireduce":
        return comm.ireduce(x, op, root=root, deterministic=True).wait()
    if form == "reduce_init":
        return comm.reduce_init(x, op, root=root, deterministic=True)()
    if form == "reduce_scatter":
        return comm.reduce_scatter(x, op, deterministic=True)
    if form == "ireduce_scatter":
        return comm.ireduce_scatter(x, op, deterministic=True).wait()
    return comm.reduce_scatter_init(x, op, deterministic=True)()


def det_worker(comm, cases):
    """Each case (dtype, op, shape, form): its result's digest on this rank."""
    out = []
    for dtype, op, shape, form in cases:
        x = det_input(dtype, op, shape, comm.rank)
        before = x.tobytes()
        y = det_call(comm, form, x, op, comm.size - 1)
        assert x.tobytes() == before, "the input was modified"
        out.append(digest(y))
    return out


def det_expected(cases, P, order=None):
    """The digests every rank must return (order: the ranks of the inputs in the fold)."""
    order = list(range(P)) if order is None else order
    want = []
    for dtype, op, shape, form in cases:
        inputs = [det_input(dtype, op, shape, r) for r in order]
        full = left_fold(dtype, op, inputs)
        if "reduce_scatter" in form:
            want.append([digest(np.array_split(full, P, axis=0)[r]) for r in range(P)])
        elif "reduce" in form and "all" not in form:
            want.append([digest(full) if r == P - 1 else None for r in range(P)])
        else:
            want.append([digest(full)] * P)
    return want


def det_cases(sizes, dtypes=None, forms=FORMS):
    cases, k = [], 0
    for dtype in dtypes or INT_DTYPES + FLOAT_DTYPES:
        for op in _ops(dtype):
            for n in sizes:
                form = forms[k % len(forms)]
                k += 1
                shape = (n, 3) if "scatter" in form else (n,)
                cases.append((dtype, op, shape, form))
    return cases


def check_det(results, cases, P, order=None):
    want = det_expected(cases, P, order)
    bad = [f"{case} rank {r}" for i, case in enumerate(cases) for r in range(P)
           if results[r][i] != want[i][r]]
    assert not bad, f"{len(bad)} results differ from the rank-order fold: {bad[:20]}"


def test_numpy_reduce_over_axis_0_is_the_row_by_row_fold():
    """The contract's reference: numpy's ufunc.reduce over axis 0 of a C-contiguous stack
    folds row by row, out = op(out, row) (for rows of two or more items; one-item rows from
    more than 8 ranks numpy sums pairwise)."""
    for dtype in ("float32", "float64", "complex64", "complex128"):
        for op in ("sum", "prod"):
            for P in (2, 3, 5, 9, 17):
                inputs = [det_input(dtype, op, (7,), r) for r in range(P)]
                acc = inputs[0].copy()
                for x in inputs[1:]:
                    acc = UFUNCS[op](acc, x)
                np.testing.assert_array_equal(UFUNCS[op].reduce(np.stack(inputs), axis=0), acc)
                if dtype.startswith("float") or op == "sum":
                    np.testing.assert_array_equal(left_fold(dtype, op, inputs), acc)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nprocs,options", [
    (2, {}),                                          # the ring: transpose and allgather paths
    (3, {"tree": "ring"}),
    (4, {"tree": "binary", "chunk_bytes": 4096}),
    (5, {"tree": "chain", "small_bytes": 256}),
    (3, {}),                                          # (the plan's own fold, where it is flat)
], ids=["P2", "P3-ring", "P4-binary", "P5-chain", "P3-auto"])
def test_deterministic_is_the_left_fold(nprocs, options):
    cases = det_cases((7, 1500)) + det_cases(
        (30001,), ["float64", "float32", "complex128", "float16", "int32"],
        ("allreduce", "reduce", "reduce_scatter", "iallreduce"))
    check_det(run_ok(det_worker, nprocs, args=(cases,), **options), cases, nprocs)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("topology,tree", [("2x4", "auto"), ("2x2x2", "ring"),
                                           ("2x4", "topology")])
def test_deterministic_on_synthetic_topologies_p8(topology, tree):
    cases = det_cases((5, 1200), ["float64", "float32", "complex64", "float16", "int64"])
    check_det(run_ok(det_worker, 8, args=(cases,), topology=topology, tree=tree,
                     chunk_bytes=8192), cases, 8)


def scan_worker(comm, cases):
    out = []
    for dtype, op, n in cases:
        x = det_input(dtype, op, (n,), comm.rank)
        out.append((digest(comm.scan(x, op, deterministic=True)),
                    digest(comm.iexscan(x, op, deterministic=True).wait()),
                    digest(comm.scan_init(x, op, deterministic=True)())))
    return out


@pytest.mark.timeout(120)
def test_deterministic_scan_and_exscan_are_numpys_accumulate():
    cases = [(d, op, n) for d in ("float64", "float32", "int16") for op in ("sum", "prod")
             for n in (5, 70001)]
    P = 3
    got = run_ok(scan_worker, P, args=(cases,), tree="ring")
    for i, (dtype, op, n) in enumerate(cases):
        stack = np.stack([det_input(dtype, op, (n,), r) for r in range(P)])
        acc = UFUNCS[op].accumulate(stack, axis=0, dtype=stack.dtype)
        for r in range(P):
            ex = UFUNCS[op].reduce(stack[:r], axis=0, dtype=stack.dtype) if r else \
                (np.zeros(n, stack.dtype) if op == "sum" else np.ones(n, stack.dtype))
            assert got[r][i] == (digest(acc[r]), digest(ex), digest(acc[r])), (dtype, op, n, r)


def shuffled_worker(comm, perm, cases, acc_values):
    """On a sub-communicator whose ranks are ordered by perm (rank r here is rank perm[r]'s
    position there): deterministic sums fold in the new order; Accumulator sums do not care."""
    sub = comm.split(0, key=perm[comm.rank])
    try:
        det = det_worker(sub, cases)
        mine = acc_values[sub.rank::sub.size]
        acc = sub.allreduce(Accumulator.of(mine))
        return det, sub.rank, digest(acc.result())
    finally:
        sub.close()


@pytest.mark.timeout(180)
def test_shuffled_rank_orders():
    P = 5
    perm = [3, 0, 4, 1, 2]
    cases = det_cases((9, 2000), ["float64", "float32", "complex128"],
                      ("allreduce", "reduce", "reduce_scatter"))
    values = adversarial_terms(np.float64, 400, seed=5)
    got = run_ok(shuffled_worker, P, args=(perm, cases, values), tree="ring")
    # rank perm[r] of the sub-communicator is rank r here: its inputs are det_input(.., r')
    # with r' its rank in the sub-communicator (det_worker uses sub.rank), so the fold is the
    # plain rank-order fold of the sub-communicator
    by_sub = [None] * P
    for r in range(P):
        by_sub[got[r][1]] = got[r][0]
    check_det(by_sub, cases, P)
    want = digest(Accumulator.of(values).result())
    assert all(g[2] == want for g in got)


# ---------------------------------------------------------------------------------------------
# Accumulator: the same bits for any partition, P, order, tree


def adversarial_terms(dtype, n, seed=0, shape=()):
    """n terms of `shape` mixing magnitudes over the whole range, exact cancellations, signed
    zeros and tiny values (finite: no inf, no NaN)."""
    dt = _dt(dtype) if isinstance(dtype, str) else np.dtype(dtype)
    real = np.float32 if dt.name in ("float16", "bfloat16", "complex64") else \
        (np.float64 if dt.kind == "c" else dt)
    rng = _rng("adv", dt.name, n, seed, shape)
    m = n * int(np.prod(shape, dtype=np.int64))
    finfo = np.finfo(real)
    lo, hi = (np.log10(float(finfo.tiny)) + 1, np.log10(float(finfo.max)) - 3) if \
        dt.name not in ("float16", "bfloat16") else (-5, 3)
    mag = 10.0 ** rng.uniform(lo, hi, m)
    v = (rng.normal(size=m) * mag).astype(real)
    k = m // 4
    v[k:2 * k] = -v[:k][rng.permutation(k)]               # exact cancellations
    v[2 * k:2 * k + 8] = [0.0, -0.0, 1.0, -1.0, 2.0 ** -60, -(2.0 ** -60), 3.0, 1e-30]
    if dt.name in ("float16", "bfloat16"):
        v = np.clip(v, -60000, 60000)
    v = rng.permutation(v).astype(real)
    out = v if dt.kind != "c" else (v + 1j * rng.permutation(v)).astype(dt)
    return out.astype(dt).reshape((n,) + tuple(shape))


def partition_worker(comm, trials, dtypes, n, shape):
    """For each trial and dtype: the terms split among the ranks at random (some ranks none),
    each rank's part added in two pieces in its own order; every form of the allreduce."""
    out = []
    P, me = comm.size, comm.rank
    for t in range(trials):
        for dtype in dtypes:
            dt = _dt(dtype)
            terms = adversarial_terms(dt, n, seed=t, shape=shape)
            rng = _rng("part", P, t, dtype)
            owner = rng.integers(0, P, n)
            if t % 3 == 1:
                owner[owner == P - 1] = 0               # (a rank with no terms at all)
            mine = terms[owner == me]
            mine = mine[_rng("order", P, t, dtype, me).permutation(len(mine))]
            acc = Accumulator(shape, dt)
            half = len(mine) // 2
            acc.add(mine[:half])
            acc.add(Accumulator.of(mine[half:], dtype=dt) if len(mine) - half else mine[half:])
            if t % 2:
                got = comm.iallreduce(acc).wait()
            else:
                got = comm.allreduce(acc)
            assert got is not acc and got.shape == tuple(shape) and got.dtype == dt
            out.append(digest(got.result(strict=False)))
            # reproducible=True: each rank's array one term
            out.append(digest(comm.allreduce(_one_term(terms, me, dt), reproducible=True)))
    return out


def _one_term(terms, r, dt):
    """Rank r's term for reproducible=True: small enough that no sum of six overflows."""
    return (terms[r] / 8).astype(dt)


def partition_expected(P, trials, dtypes, n, shape):
    want = []
    for t in range(trials):
        for dtype in dtypes:
            terms = adversarial_terms(_dt(dtype), n, seed=t, shape=shape)
            want.append(digest(Accumulator.of(terms).result(strict=False)))
            rows = [_one_term(terms, r, _dt(dtype)) for r in range(P)]
            want.append(digest(Accumulator.of(np.stack(rows)).result()))
    return want


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4, 5, 6])
def test_accumulator_same_bits_for_any_partition(nprocs):
    dtypes = FLOAT_DTYPES
    args = (3, dtypes, 300, (4,))
    got = run_ok(partition_worker, nprocs, args=args)
    want = partition_expected(nprocs, *args)
    for r in range(nprocs):
        assert got[r] == want, f"rank {r} of {nprocs}: sums differ from the terms' exact sum"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("options", [{"tree": "ring"}, {"tree": "chain"},
                                     {"tree": "binary", "small_bytes": 64},
                                     {"topology": "2x4", "tree": "topology"},
                                     {"topology": "2x2x2"}],
                         ids=["ring", "chain", "binary-noinline", "2x4-topology", "2x2x2"])
def test_accumulator_same_bits_on_every_tree_and_topology(options):
    nprocs = 8 if "topology" in options else 4
    args = (2, ["float64", "complex64", "float16"], 200, (5,))
    got = run_ok(partition_worker, nprocs, args=args, **options)
    want = partition_expected(nprocs, *args)
    assert all(g == want for g in got)


def large_terms(P, n, dtype, seed):
    """P rank's terms of n elements: adversarial, with a few NaNs, infinities and -0.0 where
    `specials` (every rank alike: the parent rebuilds them)."""
    t = adversarial_terms(_dt(dtype), P, seed=seed, shape=(n,))
    if _dt(dtype).name in ("float16", "bfloat16"):
        t = (t / 8).astype(_dt(dtype))                  # (no sum of P terms overflows)
    if seed % 2:
        rng = _rng("specials", P, n, dtype, seed)
        for value in (np.nan, np.inf, -np.inf, -0.0):
            at = rng.integers(0, n, 3)
            t[rng.integers(0, P, 3), at] = value
        t[:, 7] = -0.0                                  # (an element of -0.0 alone)
    return t


def large_worker(comm, n, dtype, seed):
    """A large Accumulator allreduce (the rounds, not the one allgather): its result's digest,
    and the same terms through reproducible=True."""
    x = large_terms(comm.size, n, dtype, seed)[comm.rank]
    acc = comm.allreduce(Accumulator.of(x[None]))
    try:
        again = digest(comm.allreduce(x, reproducible=True))
    except ValueError:                                  # (+inf met -inf: as math.fsum)
        again = "ValueError"
    return digest(acc.result(strict=False)), again


@pytest.mark.timeout(180)
@pytest.mark.parametrize("nprocs", [2, 3])
def test_accumulator_large_message_rounds(nprocs):
    n = 20000
    cases = [(d, seed) for d in ("float64", "float32", "complex64", "float16") for seed in (0, 1)]
    for dtype, seed in cases:
        got = run_ok(large_worker, nprocs, args=(n, dtype, seed))
        terms = large_terms(nprocs, n, dtype, seed)
        want = Accumulator.of(terms)
        bits = digest(want.result(strict=False))
        try:
            strict = digest(want.result())
        except ValueError:
            strict = "ValueError"
        assert all(g == (bits, strict) for g in got), (dtype, seed, got)
        if dtype == "float64" and not seed:         # (exact: math.fsum's bits, element by
            fs = np.array([math.fsum(terms[:, i]) for i in range(n)])     # element)
            assert digest(fs) == bits


# ---------------------------------------------------------------------------------------------
# Accumulator against math.fsum and the exactly rounded sum (one process)


def fsum_or_error(values):
    try:
        return math.fsum(values)
    except (ValueError, OverflowError) as exc:
        return type(exc)


def acc_sum(values, strict=True):
    try:
        return float(Accumulator.of(np.asarray(values, np.float64)).result(strict=strict))
    except (ValueError, OverflowError) as exc:
        return type(exc)


def same(a, b):
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) ==
                                                     math.copysign(1, b))
    return a == b


ADVERSARIAL = [
    [1e16, 1.0, -1e16],
    [1e308, 1e-308, -1e308],
    [1e100, 1.0, -1e100, 1e-100],
    [2.0 ** 1023, 2.0 ** -1074, -(2.0 ** 1023)],
    [5e-324, 5e-324, -5e-324],
    [1.0, 2.0 ** -53, 2.0 ** -53],                        # ties: round half even
    [1.0, 2.0 ** -53],
    [1.0 + 2.0 ** -52, 2.0 ** -53],
    [0.1] * 10,
    [1e300, -1e300] * 50 + [1e-300],
    [1.7976931348623157e308, -1.7976931348623157e308, 1.0],
    [float("nan"), 1.0],
    [float("inf"), 1.0, 1e308],
    [float("-inf"), -5.0],
    [float("inf"), float("-inf")],
    [float("nan"), float("inf"), float("-inf")],
    [1e308, 1e308],
    [-1e308, -1e308, 1.0],
]


@pytest.mark.parametrize("values", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_accumulator_is_math_fsum(values):
    for perm in (values, values[::-1], sorted(values, key=abs)):
        assert same(acc_sum(perm), fsum_or_error(perm)), (perm, acc_sum(perm),
                                                           fsum_or_error(perm))


def test_accumulator_where_fsum_has_no_word():
    """Beyond math.fsum: no partial sum overflows; signed zeros as IEEE addition gives them
    (-0.0 only when every term is -0.0); strict=False gives NaN and infinities."""
    assert acc_sum([1e308, 1e308, -1e308]) == 1e308          # (fsum: OverflowError)
    assert fsum_or_error([1e308, 1e308, -1e308]) is OverflowError
    assert same(acc_sum([-0.0, -0.0]), -0.0)
    assert same(acc_sum([-0.0, 0.0]), 0.0)
    assert same(acc_sum([-1.0, 1.0, -0.0]), 0.0)
    assert same(acc_sum([]), 0.0)
    assert same(acc_sum([float("inf"), float("-inf")], strict=False), float("nan"))
    assert acc_sum([1e308, 1e308], strict=False) == float("inf")
    assert acc_sum([-1e308, -1e308], strict=False) == float("-inf")
    assert acc_sum([float("inf"), 1e308, 1e308]) == float("inf")     # (fsum: OverflowError)
    # the exact tie at the top of the range rounds to even, past the largest finite: inf
    top = np.finfo(np.float64).max
    assert acc_sum([top, 2.0 ** 970], strict=False) == float("inf")
    assert acc_sum([top, 2.0 ** 969]) == top


def test_accumulator_random_cancellations_are_fsum():
    rng = np.random.default_rng(7)
    for k in range(200):
        n = int(rng.integers(1, 60))
        v = rng.normal(size=n) * 10.0 ** rng.integers(-300, 300, n)
        v = np.concatenate([v, -v[rng.permutation(n)][: n // 2],
                            rng.normal(size=3) * 10.0 ** rng.integers(-20, 20, 3)])
        v = rng.permutation(v)
        assert same(acc_sum(v), fsum_or_error(v)), v


def nearest(exact, dt):
    """The float of dtype dt nearest to the Fraction `exact` (ties to even), beyond range an
    infinity: by search among the neighbours of a first guess."""
    guess = np.asarray(float(exact)).astype(dt)
    if not np.isfinite(guess):
        guess = np.asarray(np.finfo(np.float32 if dt.name == "bfloat16" else dt).max
                           if exact > 0 else -np.finfo(np.float32 if dt.name == "bfloat16"
                                                       else dt).max).astype(dt)
    cands = [guess]
    for _ in range(2):
        cands += [np.nextafter(c.astype(np.float64), np.inf).astype(dt) for c in cands] + \
                 [np.nextafter(c.astype(np.float64), -np.inf).astype(dt) for c in cands]
    cands = [c for c in cands if np.isfinite(c)]
    widen = (lambda c: F(float(c.astype(np.float32)))) if dt.name == "bfloat16" else \
        (lambda c: F(float(c)))

    def key(c):
        bits = int(np.asarray(c).view(np.uint16 if dt.itemsize == 2 else
                                      (np.uint32 if dt.itemsize == 4 else np.uint64)))
        return (abs(widen(c) - exact), bits & 1)
    return min(cands, key=key)


@pytest.mark.parametrize("dtype", ["float32", "float16"] + (["bfloat16"] if BF16 else []))
def test_accumulator_rounds_once_to_the_nearest(dtype):
    dt = _dt(dtype)
    rng = np.random.default_rng(3)
    for k in range(150):
        n = int(rng.integers(1, 40))
        v = (rng.normal(size=n) * 10.0 ** rng.integers(-3, 3, n)).astype(np.float32)
        if dtype != "float32":
            v = np.clip(v, -30000, 30000)
        v = v.astype(dt)
        exact = sum((F(float(x.astype(np.float32))) for x in v), F(0))
        got = Accumulator.of(v).result(strict=False)
        assert got.dtype == dt
        if exact == 0:
            continue
        want = nearest(exact, dt)
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), (v, got, want)


def test_accumulator_complex_parts_apart():
    z = adversarial_terms(np.complex128, 200, seed=2)
    got = Accumulator.of(z).result()
    assert got == complex(math.fsum(z.real), math.fsum(z.imag))
    assert Accumulator.of(adversarial_terms(np.complex64, 50)).result().dtype == np.complex64


def test_accumulator_api():
    x = np.arange(12.0).reshape(3, 4) / 7
    a = Accumulator.of(x)                          # axis 0: sums of shape (4,)
    assert a.shape == (4,) and a.dtype == np.float64 and a.ndim == 1 and a.size == 4
    np.testing.assert_array_equal(a.result(), [math.fsum(x[:, j]) for j in range(4)])
    assert Accumulator.of(x, axis=1).shape == (3,)
    assert Accumulator.of(x, axis=-1).shape == (3,)
    s = Accumulator.of(x, axis=None)
    assert s.shape == () and float(s.result()) == math.fsum(x.ravel())
    b = Accumulator((4,))
    b.add(x[:1]).add(x[1:])
    b += Accumulator.of(np.zeros((0, 4)))
    assert b.result().tobytes() == a.result().tobytes()
    c = pickle.loads(pickle.dumps(a))
    assert c.result().tobytes() == a.result().tobytes()
    d = a.copy()
    d.add(x)
    assert a.result().tobytes() != d.result().tobytes()
    assert "Accumulator" in repr(a)
    assert Accumulator.of(np.arange(3, dtype=np.int16), dtype=np.float32).result() == 3.0
    with pytest.raises(TypeError):
        Accumulator.of(np.arange(3))               # int64: not floats
    with pytest.raises(TypeError):
        Accumulator.of(np.arange(3.0), dtype=np.float32)    # float64 -> float32: not exact
    with pytest.raises(TypeError):
        Accumulator((2,), np.int32)
    with pytest.raises(ValueError):
        a.add(np.zeros((2, 5)))                    # sums of shape (5,) into (4,)
    with pytest.raises(TypeError):
        a.add(Accumulator((4,), np.float32))
    with pytest.raises(ValueError):
        Accumulator.of(np.float64(1.0))            # 0-d: no axis
    with pytest.raises(ValueError):
        Accumulator.of(x, axis=2)


def test_accumulator_of_a_torch_tensor():
    torch = pytest.importorskip("torch")
    t = torch.tensor([[1e16, 1.0], [1.0, 2.0], [-1e16, 3.0]], dtype=torch.float64)
    assert Accumulator.of(t).result().tolist() == [1.0, 6.0]


# ---------------------------------------------------------------------------------------------
# a distributed conjugate gradient: the same residuals at every P


def cg_worker(comm, n, iters):
    """CG on a shifted 1-D Laplacian (2.1 on the diagonal, -1 beside it) with rows split among the
    ranks; every dot product an Accumulator allreduce of the local products; the matrix-vector
    product a stencil on the gathered vector: each number computed the same way at every P."""
    b = np.array_split(np.arange(n), comm.size)[comm.rank]
    lo, hi = b[0], b[-1] + 1
    rhs = np.sin(np.arange(lo, hi) * 0.37) + 0.01 * np.arange(lo, hi)

    def dot(u, v):
        return float(comm.allreduce(Accumulator.of(u * v)).result())

    def matvec(p_local):
        p = comm.allgather(p_local, axis=0)
        padded = np.concatenate([[0.0], p, [0.0]])
        i = np.arange(lo, hi) + 1
        return 2.1 * padded[i] - padded[i - 1] - padded[i + 1]

    x = np.zeros(hi - lo)
    r = rhs.copy()
    p = r.copy()
    rr = dot(r, r)
    history = [rr.hex()]
    for _ in range(iters):
        Ap = matvec(p)
        alpha = rr / dot(p, Ap)
        x += alpha * p
        r -= alpha * Ap
        rr_new = dot(r, r)
        history.append(rr_new.hex())
        p = r + (rr_new / rr) * p
        rr = rr_new
    return history, digest(comm.allgather(x, axis=0))


@pytest.mark.timeout(180)
def test_cg_residual_history_is_the_same_at_every_p():
    runs = {P: run_ok(cg_worker, P, args=(300, 40)) for P in (1, 2, 3, 4)}
    first = runs[1][0]
    for P, got in runs.items():
        for r in range(P):
            assert got[r] == first, f"P={P} rank {r}: another residual history than P=1's"
    assert float.fromhex(first[0][-1]) < 1e-6 * float.fromhex(first[0][0])   # (it converges)


# ---------------------------------------------------------------------------------------------
# ranks that disagree; local errors


def mismatch_worker(comm, kind):
    """Rank 0 makes one call, the others another: every rank must raise
    CollectiveMismatchError, then the group works on."""
    me = comm.rank
    x = np.arange(50000.0) if kind.endswith("large") else np.arange(5.0)
    try:
        if kind == "det_op":
            comm.allreduce(x, deterministic=True, op="max" if me else "min")
        elif kind.startswith("det"):
            comm.allreduce(x, deterministic=me == 0)
        elif kind == "reduce":
            comm.reduce(x, root=1, deterministic=me != 0)
        elif kind == "reduce_root":
            comm.reduce(x, root=me % 2, deterministic=True)
        elif kind == "scatter":
            comm.reduce_scatter(x, deterministic=me == 1)
        elif kind == "scan":
            comm.scan(x, deterministic=me == 0)
        elif kind == "repro":
            comm.allreduce(x, reproducible=me == 0)
        elif kind == "acc_dtype":
            comm.allreduce(Accumulator.of(x[None].astype(np.float32 if me else np.float64)))
        elif kind == "acc_shape":
            comm.allreduce(Accumulator.of(np.ones((2, 3 + me))))
    except shmtree.CollectiveMismatchError as exc:
        said = str(exc)
    else:
        said = None
    return said, comm.allreduce(np.ones(2), deterministic=True).tolist()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["det", "det_large", "reduce", "reduce_root", "scatter",
                                  "scan", "repro", "acc_dtype", "acc_shape", "det_op"])
def test_disagreeing_ranks_raise_on_every_rank(kind):
    P = 3
    got = run_ok(mismatch_worker, P, args=(kind,), tree="ring")
    for said, after in got:
        assert said is not None, f"{kind}: a rank got no CollectiveMismatchError"
        assert after == [3.0, 3.0]
    words = {"det": "deterministic", "det_large": "deterministic", "reduce": "deterministic",
             "reduce_root": "root", "scatter": "deterministic", "scan": "deterministic",
             "repro": "Accumulator", "acc_dtype": "float32", "acc_shape": "Accumulator",
             "det_op": "'m"}[kind]
    assert all(words in said for said, _ in got), got


def local_errors_worker(comm):
    x = np.arange(4.0)
    raised = []
    for call in (lambda: comm.allreduce(x, deterministic="yes"),
                 lambda: comm.allreduce(x, reproducible=1),
                 lambda: comm.allreduce(x, "prod", reproducible=True),
                 lambda: comm.allreduce(np.arange(4), reproducible=True),
                 lambda: comm.allreduce(Accumulator.of(x), out=np.empty(())),
                 lambda: comm.allreduce(Accumulator.of(x), deterministic=True),
                 lambda: comm.allreduce(Accumulator.of(x), op="max"),
                 lambda: comm.iallreduce(x, deterministic=True, reproducible=True),
                 lambda: comm.reduce_scatter(x, deterministic=None)):
        try:
            call()
        except (TypeError, ValueError) as exc:
            raised.append(type(exc).__name__)
        else:
            raised.append(None)
    return raised, comm.allreduce(x, reproducible=True).tolist()


@pytest.mark.timeout(60)
def test_local_errors():
    got = run_ok(local_errors_worker, 2)
    for raised, after in got:
        assert raised == ["ValueError", "ValueError", "ValueError", "TypeError", "ValueError",
                          "ValueError", "ValueError", "ValueError", "ValueError"], raised
        assert after == [0.0, 2.0, 4.0, 6.0]


def out_worker(comm):
    """out= of every kind (in place, a buffer, a strided view), the input untouched."""
    x = np.arange(7.0) * (comm.rank + 1) / 3
    y = x.copy()
    comm.allreduce(y, out=y, deterministic=True)
    buf = np.zeros(14)
    comm.allreduce(x, out=buf[::2], reproducible=True)
    z = np.zeros(7)
    got = comm.allreduce(x, out=z, reproducible=True)
    return y.tolist(), buf[::2].tolist(), got is z, z.tolist()


@pytest.mark.timeout(60)
def test_out_arguments():
    got = run_ok(out_worker, 3)
    xs = [np.arange(7.0) * (r + 1) / 3 for r in range(3)]
    fold = ((xs[0] + xs[1]) + xs[2]).tolist()
    exact = [math.fsum(v[i] for v in xs) for i in range(7)]
    for y, strided, same_z, z in got:
        assert y == fold and strided == exact and same_z and z == exact


# ---------------------------------------------------------------------------------------------
# across simulated nodes (from_mpi): tests/mpi_repro_prog.py


@pytest.mark.timeout(240)
@pytest.mark.parametrize("nprocs,node_size", [(4, 2), (5, 2)], ids=["2x2", "2+2+1"])
def test_across_nodes(nprocs, node_size, monkeypatch):
    pytest.importorskip("mpi4py")
    import test_multinode as tm
    monkeypatch.setattr(tm, "PROG", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "mpi_repro_prog.py"))
    rc, out, _ = tm._launch(nprocs, "repro", node_size, timeout=200)
    assert rc == 0 and "OK repro" in out, out[-4000:]


# ---------------------------------------------------------------------------------------------
# torch: the backend's reduction mode (SHMTREE_TORCH_REDUCTION, set_reduction)


def torch_mode_worker(rank, size, store_path, outdir):
    import torch
    import torch.distributed as dist

    import shmtree.torch

    dist.init_process_group("shmtree", store=dist.FileStore(store_path, size), rank=rank,
                            world_size=size)
    got = {"mode": shmtree.torch.reduction(),
           "comm": type(shmtree.torch.communicator()).__name__}
    terms = [1e16, 1.0, -1e16]                   # exact sum 1; rank-order fold 0
    t = torch.tensor([terms[rank], 2.0 ** -30 * rank], dtype=torch.float64)
    dist.all_reduce(t)
    got["sum"] = t.tolist()
    t = torch.tensor([terms[rank]], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    got["avg"] = t.tolist()
    t = torch.tensor([terms[rank]] * 70001, dtype=torch.float32)     # posted (large)
    dist.all_reduce(t)
    got["big"] = (float(t[0]), float(t[-1]))
    t = torch.tensor([terms[rank]], dtype=torch.float64)
    dist.reduce(t, dst=0)
    got["reduce"] = t.tolist() if rank == 0 else None
    t = torch.tensor([rank + 1, 2], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.PRODUCT)
    got["prod"] = t.tolist()
    shmtree.torch.set_reduction("deterministic")
    t = torch.tensor([terms[rank]], dtype=torch.float64)
    dist.all_reduce(t)
    got["deterministic"] = t.tolist()
    out = torch.empty(1, dtype=torch.float64)
    dist.reduce_scatter_tensor(out, torch.tensor([terms[rank]] * size, dtype=torch.float64))
    got["reduce_scatter"] = out.tolist()
    # a rank in another mode: every rank's operation fails (ranks disagree on the call)
    shmtree.torch.set_reduction("default" if rank == 1 else "deterministic")
    try:
        dist.all_reduce(torch.ones(3, dtype=torch.float64))
        got["mismatch"] = None
    except RuntimeError as exc:
        got["mismatch"] = "disagree" in str(exc)
    shmtree.torch.set_reduction("default")
    t = torch.ones(2)
    dist.all_reduce(t)
    got["after"] = t.tolist()
    try:
        shmtree.torch.set_reduction("exact")
    except ValueError:
        got["bad_mode"] = True
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(got, f)
    dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_torch_backend_reduction_modes(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    mp = pytest.importorskip("torch.multiprocessing")
    monkeypatch.setenv("SHMTREE_TORCH_REDUCTION", "reproducible")
    size = 3
    mp.spawn(torch_mode_worker, args=(size, str(tmp_path / "store"), str(tmp_path)),
             nprocs=size, join=True)
    got = []
    for r in range(size):
        with open(tmp_path / f"rank{r}.pkl", "rb") as f:
            got.append(pickle.load(f))
    exact_tail = math.fsum(2.0 ** -30 * r for r in range(size))
    for r, g in enumerate(got):
        assert g["mode"] == "reproducible" and g["comm"] == "Communicator"
        assert g["sum"] == [1.0, exact_tail]                  # exact: not the fold's 0.0
        assert g["avg"] == [1.0 / 3]
        assert g["big"] == (1.0, 1.0)
        assert g["reduce"] == ([0.0] if r == 0 else None)     # (deterministic: the fold)
        assert g["prod"] == [6, 8]
        assert g["deterministic"] == [0.0] and g["reduce_scatter"] == [0.0]
        assert g["mismatch"] is True, g
        assert g["after"] == [3.0, 3.0] and g["bad_mode"]


# ---------------------------------------------------------------------------------------------
# two ranks: the ring schedule itself folds x_0 op x_1 (Engine.call's RANK_ORDER)


def pair_order_worker(comm, n, shared):
    from shmtree import _engine
    eng = comm._engine
    colls = []

    class Recorder:                       # (the engine calls each way in makes)
        def call(self, coll, *args):
            got = eng.call(coll, *args)
            if got is not None:
                colls.append(coll)
            return got

        def __getattr__(self, name):
            return getattr(eng, name)

    a, b = np.uint64(0x7FF8000000000001), np.uint64(0x7FF8000000000002)
    bits = np.arange(n, dtype=np.uint64) * 2654435761 % (1 << 52) + (1023 << 52)
    bits[::3] = a if comm.rank == 0 else b      # (NaN meets NaN: the left one is the result)
    x = comm.empty(n, np.float64) if shared else np.empty(n)
    x[...] = bits.view(np.float64)
    out = {}
    comm._engine = Recorder()
    try:
        for how in ("plain", "out", "init", "i"):
            before = len(colls)
            if how == "plain":
                got = comm.allreduce(x, deterministic=True)
            elif how == "out":
                got = comm.allreduce(x, out=np.empty(n), deterministic=True, timeout=60)
            elif how == "init":
                got = comm.allreduce_init(x, deterministic=True)()
            else:
                got = comm.iallreduce(x, deterministic=True).wait()
            out[how] = (sorted(set(got.view(np.uint64)[::3].tolist())), colls[before:],
                        hashlib.sha256(got.tobytes()).hexdigest())
        plain = comm.allreduce(x)
        out["not deterministic"] = plain.view(np.uint64)[::3].tolist()
    finally:
        comm._engine = eng
    return out, comm._plan.large_schedule


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("n", [1 << 17, (1 << 20) + 3])
def test_two_ranks_deterministic_is_the_rings_own_call(n, shared):
    """P = 2, past the inline round: deterministic=True is the plain engine allreduce, whose
    ring schedule has rank 0 fold its own input first (every block x_0 op x_1: where NaNs of
    two payloads meet, rank 0's), on private and on shared arrays (the single copy, whose fold
    follows the ring's order, is not taken), every way in."""
    from shmtree import _engine
    outs = run_ok(pair_order_worker, 2, args=(n, shared))
    (o0, schedule), (o1, _) = outs
    assert schedule == "ring"
    for how in ("plain", "out", "init", "i"):
        nans, colls, digest = o0[how]
        assert nans == [0x7FF8000000000001], (how, [hex(v) for v in nans])
        assert colls == [_engine.ALLREDUCE], (how, colls)
        assert o1[how][2] == digest, how                  # (the same bits on both ranks)
    # the plain call folds half of the blocks x_1 op x_0 (so the test sees the rule)
    assert 0x7FF8000000000002 in o0["not deterministic"]


# ---------------------------------------------------------------------------------------------
# The Accumulator's element loops (shmtree/_csrc/accum_loops.h): the baseline and the AVX2
# copies, against Python integers; reproducible=True's float64 path and its ways back to the
# general one

def _isas():
    from shmtree import _accum
    have = [0] + ([1] if _accum.use_isa(1) else [])
    _accum.use_isa(1)
    return have


def _value(q, limbs):
    """The exact values of a state (q int16[n], limbs int64[n, W]) as Fractions."""
    out = []
    for e in range(q.shape[0]):
        if q[e] == 32767:
            out.append(F(0))
            continue
        v = sum(int(limbs[e, k]) << (52 * k) for k in range(limbs.shape[1]))
        out.append(F(v) * F(2) ** int(q[e]))
    return out


def _kernel_terms(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * 2.0 ** rng.integers(-60, 60, n)
    x[3::11] = -x[3::11]
    x[::7] = 0.0
    x[5::13] = rng.standard_normal(x[5::13].shape) * 1e-310       # (subnormals)
    x[6::17] = 2.0 ** 52 + rng.integers(0, 2 ** 20, x[6::17].shape)
    return x


@pytest.mark.parametrize("isa", [0, 1])
def test_accumulator_loops_are_exact_on_every_instruction_set(isa):
    from shmtree import _accum
    if isa not in _isas():
        pytest.skip("this CPU has no AVX2")
    n = 3001
    try:
        assert _accum.use_isa(isa) and _accum.isa() == isa
        for seed in range(3):
            x = _kernel_terms(n, seed)
            q, limbs, flags = _accum.from_values(x)
            want = [F(v) for v in x]
            assert _value(q, limbs) == want
            # aligned: every element at a lower quantum (shifts 0..70: the loop's and the
            # general way's), where it fits two limbs with a bit of headroom, else not written
            shift = np.random.default_rng(seed).integers(0, 71, n)
            qg = np.where(q == 32767, 0, q - shift).astype(np.int16)
            out = np.full((n, 2), 12345, np.int64)
            best = _accum.aligned(q, limbs, qg, 1, out)
            fits = np.array([q[e] == 32767 or (abs(int(limbs[e, 1]) * 2 ** 52 + int(limbs[e, 0]))
                                                .bit_length() + int(shift[e]) + 1 + 2 + 51)
                             // 52 <= 2 for e in range(n)])
            assert best == (2 if fits.all() else best) and (best > 2) == (not fits.all())
            got = _value(np.where(q == 32767, 32767, qg).astype(np.int16), out)
            assert all(got[e] == want[e] for e in range(n) if fits[e])
            assert all(0 <= out[e, 0] < 2 ** 52 for e in range(n) if fits[e])
            # a column sum of two aligned states, carried: the exact sums
            sums = out.copy()
            sums[fits] += out[fits][::-1]
            qs = np.where(q == 32767, 32767, qg).astype(np.int16)
            pairs = np.where(fits)[0]
            sums2 = np.zeros_like(out)
            sums2[pairs] = out[pairs] * 2                      # (x + x, limb by limb)
            _accum.normalize_sum(sums2, qs)
            assert all(_value(qs[e:e + 1], sums2[e:e + 1])[0] == 2 * want[e] for e in pairs)
            assert all(qs[e] == 32767 for e in pairs if x[e] == 0)
            # the float64 path: quanta, limbs at the group's quantum, sums rounded
            negq = np.empty(n, np.int16)
            assert _accum.ulp_quanta(x, negq) == 0
            other = _kernel_terms(n, seed + 10)
            negq2 = np.empty(n, np.int16)
            _accum.ulp_quanta(other, negq2)
            group = np.maximum(negq, negq2)
            la, lb = np.empty((n, 2), np.int64), np.empty((n, 2), np.int64)
            bad = _accum.ulp_limbs(x, group, 1, la) + _accum.ulp_limbs(other, group, 1, lb)
            near = np.array([x[e] == 0 or other[e] == 0 or
                             abs(math.frexp(x[e])[1] - math.frexp(other[e])[1]) < 20
                             for e in range(n)])
            if bad:                                    # (only where the terms lie far apart)
                assert not near.all()
            sel = [e for e in range(n) if near[e] and abs(x[e]) > 1e-300 and
                   abs(other[e]) > 1e-300]
            assert sel
            qg2 = (-group).astype(np.int16)
            for e in sel:
                assert _value(qg2[e:e + 1], la[e:e + 1])[0] == F(x[e])
            s = la + lb
            y = np.empty(n)
            _accum.round_sums(s, group, y)
            for e in sel:
                exact = float(F(x[e]) + F(other[e]))
                assert y[e] == exact or not (2.3e-308 < abs(exact) < 1.7e308)
        specials = np.array([1.0, -0.0, np.inf, -np.inf, np.nan, 0.0, 5e-324])
        negq = np.empty(7, np.int16)
        assert _accum.ulp_quanta(specials, negq) == 4
        assert list(negq) == [52, -32767, -32767, -32767, -32767, -32767, 1074]
    finally:
        _accum.use_isa(1)


def fast_path_worker(comm, n, case, isa):
    from shmtree import _accum
    _accum.use_isa(isa)
    x = fast_path_terms(comm.size, n, case)[comm.rank]
    y = np.full(n, 7.0)
    try:
        comm.allreduce(x, out=y, reproducible=True)
    except (ValueError, OverflowError) as exc:
        return type(exc).__name__
    return digest(y)


def fast_path_terms(P, n, case):
    rng = np.random.default_rng(zlib.crc32(f"{P} {n} {case}".encode()))
    t = rng.standard_normal((P, n))
    if case == "spread":                 # (terms 2**60 / 2**100 apart: more than two words,
        t[0, 11] *= 2.0 ** 60            # more than 128 bits)
        t[0, 12] *= 2.0 ** 100
    elif case == "special":
        t[P - 1, 5] = -0.0
    elif case == "subnormal":            # (sums below the least normal double)
        t[:, :40] *= 1e-309
    elif case == "tiny":                 # (quanta below -1022 everywhere)
        t *= 1e-300
    elif case == "overflow":
        t[:, 3] = 1.5e308
    elif case == "cancel":
        t[0] += 1e16
        t[1] -= 1e16
    return t


@pytest.mark.timeout(240)
@pytest.mark.parametrize("isa", [0, 1])
@pytest.mark.parametrize("nprocs", [2, 3])
def test_reproducible_float64_path_and_its_ways_back(nprocs, isa):
    """reproducible=True of float64: small (one allgather of the terms, summed in 128 bits:
    _rounding.sum_rows) and past the small path (the two-word rounds of ulp-aligned terms),
    and where they do not serve (a -0.0 term, terms too far apart, results that are not
    normal doubles, an overflow) the general path: the same bits as the Accumulator of every
    rank's terms, on every rank, on either instruction set."""
    if isa not in _isas():
        pytest.skip("this CPU has no AVX2")
    for n in (60, 4099):
        for case in ("plain", "cancel", "spread", "special", "subnormal", "tiny", "overflow"):
            got = run_ok(fast_path_worker, nprocs, args=(n, case, isa))
            try:
                want = digest(Accumulator.of(fast_path_terms(nprocs, n, case)).result())
            except OverflowError:
                want = "OverflowError"
            assert got == [want] * nprocs, (n, case)
