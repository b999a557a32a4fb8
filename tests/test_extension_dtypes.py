"""Arrays of ml_dtypes' types (bfloat16, the float8s, int4) move as bytes through broadcast and
allgather, and a mismatch names them in words (calls.dtype_text).  float8_e5m2's dtype.str is
'<f1', which numpy does not parse: describing it once raised TypeError in broadcast and
allgather (calls._named_by_str)."""
import numpy as np
import pytest

import shmtree
from shmtree.frontend import calls

from procutil import run_ok

ml_dtypes = pytest.importorskip("ml_dtypes")

NAMES = [n for n in ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3b11fnuz",
                     "float8_e4m3fnuz", "float8_e5m2fnuz", "int4", "uint4")
         if hasattr(ml_dtypes, n)]


def _values(name, n, rank):
    kind = getattr(ml_dtypes, name)
    return (np.arange(n, dtype=np.float32) % 7 + rank).astype(kind)


def moves_worker(comm, name, n):
    a = _values(name, n, comm.rank)
    got = {}
    got["broadcast"] = comm.broadcast(a, root=comm.size - 1)
    got["broadcast_none"] = comm.broadcast(a if comm.rank == 0 else None, root=0)
    got["allgather"] = comm.allgather(a)
    got["allgather0"] = comm.allgather(a[:n - comm.rank], axis=0)
    req = comm.iallgather(a)
    got["iallgather"] = req.result()
    return {k: (str(v.dtype), v.view(np.uint8).tobytes()) for k, v in got.items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", [5, 70000])
def test_extension_dtypes_move_as_bytes(name, n):
    P = 2
    outs = run_ok(moves_worker, P, args=(name, n))
    raw = lambda a: a.view(np.uint8).tobytes()          # noqa: E731
    rows = [_values(name, n, r) for r in range(P)]
    want = {"broadcast": raw(rows[P - 1]), "broadcast_none": raw(rows[0]),
            "allgather": raw(np.stack(rows)), "iallgather": raw(np.stack(rows)),
            "allgather0": raw(np.concatenate([rows[r][:n - r] for r in range(P)]))}
    for out in outs:
        for key, (dtype, data) in out.items():
            assert dtype == name, (key, dtype)
            assert data == want[key], key


def test_dtype_text_names_extension_types():
    for name in NAMES:
        assert calls.dtype_text(calls.dtype_digest(np.dtype(getattr(ml_dtypes, name)))) == name
    assert calls.dtype_text(calls.dtype_digest(np.dtype(">i4"))) == ">i4"
    structured = calls.dtype_text(calls.dtype_digest(np.dtype([("a", "<f4")])))
    assert structured.startswith("#") and "structured" in structured


def mismatch_worker(comm):
    kind = ml_dtypes.bfloat16 if comm.rank == 0 else np.float16
    try:
        comm.allgather(np.zeros(3, kind))
    except shmtree.CollectiveMismatchError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(60)
def test_a_mismatch_names_bfloat16():
    for text in run_ok(mismatch_worker, 2):
        assert text is not None and "bfloat16" in text and "float16" in text, text
