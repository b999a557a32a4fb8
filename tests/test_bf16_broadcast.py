"""bfloat16 broadcast (issue 21, item 8): torch.bfloat16 tensors and ml_dtypes.bfloat16 arrays,
in place (broadcast(t, out=t)) and not, whatever round carries the data (inline in the first
round, a round of its own, the chain), at P=2 and P=3.  (ml_dtypes' bfloat16 has dtype.str
'<V2', which names another dtype: the root's description must not travel as that str.)"""
import numpy as np
import pytest

from procutil import run_ok

ml_dtypes = pytest.importorskip("ml_dtypes")


def worker(comm, kinds):
    bf = ml_dtypes.bfloat16
    out = []
    for kind in kinds:
        for n in (7, 4099, 70001, 4099, 7):         # (each size after another: every round)
            want = (np.arange(n, dtype=np.float32) % 251).astype(bf)
            if kind == "torch":
                import torch
                t = torch.from_numpy(want.view(np.int16).copy()).view(torch.bfloat16)
                if comm.rank != 0:
                    t = torch.zeros(n, dtype=torch.bfloat16)
                got = comm.broadcast(t, 0, out=t)
                ok = got is t and np.array_equal(t.view(torch.int16).numpy(),
                                                 want.view(np.int16))
            else:
                a = want.copy() if comm.rank == 0 else np.zeros(n, bf)
                got = comm.broadcast(a, 0, out=a) if kind == "ml_inplace" else \
                    comm.broadcast(a if comm.rank == 0 else None, 0)
                ok = (got.dtype == np.dtype(bf)
                      and np.array_equal(got.view(np.int16), want.view(np.int16))
                      and (kind != "ml_inplace" or got is a))
            out.append((kind, n, ok))
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("P", [2, 3])
def test_bfloat16_broadcast_every_round(P):
    kinds = ["ml_inplace", "ml_new"]
    try:
        import torch  # noqa: F401
        kinds.insert(0, "torch")
    except ImportError:
        pass
    for rank, out in enumerate(run_ok(worker, P, args=(kinds,))):
        bad = [case for case in out if not case[2]]
        assert not bad, (rank, bad)
