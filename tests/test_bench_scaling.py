"""shmtree-bench scaling: P x collective x size x private/shared arrays, shmtree beside MPI.

End to end for a tiny case (P=2, two sizes, two timed calls per cell), the table's and the
files' structure and that every time is positive (no timing asserts); without MPI (an
interpreter that does not exist) the header says so and shmtree's numbers are still there; the
choice of process counts, without measuring.
"""
import csv
import importlib.util
import json

import pytest

from shmtree.bench import compare, scaling
from shmtree.bench.__main__ import main
from test_bench import keep_signal_handlers, needs_shmtree, no_leftovers  # noqa: F401 (autouse)

TINY = ["scaling", "--nprocs", "2", "--sizes", "8,4K", "--iters", "2"]
HEADERS = ["P", "collective", "size", "arrays", "shmtree (us)"]


def _table(out):
    """(header cells, data rows as cell lists) of the text table in `out`."""
    lines = [line for line in out.splitlines() if line and not line.startswith("#")]
    rule = next(i for i, line in enumerate(lines) if set(line) <= {"-", " "})
    return lines[rule - 1], [line.split() for line in lines[rule + 1:]]


def _positive(text):
    return float(text.rstrip("x")) > 0


@needs_shmtree
@pytest.mark.timeout(240)
def test_scaling_table_every_collective_private_and_shared(tmp_path, capsys):
    have_mpi = importlib.util.find_spec("mpi4py") is not None
    js, cs = tmp_path / "s.json", tmp_path / "s.csv"
    assert main(TINY + ["--json", str(js), "--csv", str(cs)]) == 0
    out = capsys.readouterr().out
    header, rows = _table(out)
    for name in HEADERS + ["MPI/shmtree"]:
        assert name in header, header
    every = scaling.default_collectives()     # all ten where shmtree has them, else the five
    assert every[:5] == ["allreduce", "broadcast", "reduce", "allgather", "reduce_scatter"]
    want = [(c, size, arrays) for c in every for size in ("8", "4")
            for arrays in ("private", "shared")]
    # a row: P, collective, size value, size unit, arrays, shmtree, MPI, ratio
    assert [(r[1], r[2], r[4]) for r in rows] == want, rows
    assert all(r[0] == "2" and len(r) == 8 for r in rows), rows
    assert all(_positive(r[5]) for r in rows), rows
    if have_mpi:
        assert "# MPI: MPICH" in out or "# MPI: Open MPI" in out, out
        for r in rows:
            assert _positive(r[6]) and _positive(r[7]), r
    else:
        assert "# MPI: not measured" in out and all(r[6] == "n/a" for r in rows)
    doc = json.loads(js.read_text())
    assert doc["command"] == "scaling" and doc["options"]["nprocs"] == [2]
    assert [(r["collective"], r["size"], r["arrays"]) for r in doc["rows"]] == [
        (c, 8 if s == "8" else 4096, a) for c, s, a in want]
    for r in doc["rows"]:
        assert r["nprocs"] == 2 and r["shmtree_us"] > 0 and r["count"] in (2, 1024), r
        if have_mpi:
            assert r["mpi_us"] > 0, r
            assert r["mpi_vs_shmtree"] == pytest.approx(r["mpi_us"] / r["shmtree_us"])
    with open(cs, newline="") as f:
        lines = list(csv.DictReader(f))
    assert len(lines) == len(want) and list(lines[0]) == list(scaling.COLUMNS)
    assert all(float(line["shmtree_us"]) > 0 for line in lines)


@needs_shmtree
@pytest.mark.timeout(120)
def test_scaling_without_mpi_says_so_and_prints_shmtree(tmp_path, capsys):
    missing = str(tmp_path / "no-such-python")
    assert main(["scaling", "--nprocs", "2", "--sizes", "64", "--iters", "2",
                 "--collectives", "allreduce,reduce_scatter", "--mpi-python", missing]) == 0
    out = capsys.readouterr().out
    assert f"# MPI: not measured: n/a (no such interpreter): no executable {missing}" in out
    assert "# shmtree's numbers only" in out
    _, rows = _table(out)
    assert [(r[1], r[4]) for r in rows] == [("allreduce", "private"), ("allreduce", "shared"),
                                            ("reduce_scatter", "private"),
                                            ("reduce_scatter", "shared")]
    assert all(_positive(r[5]) and r[6] == "n/a" and r[7] == "-" for r in rows), rows


def test_scaling_process_counts():
    cores = 2
    assert scaling.choose_nprocs(None, None, cores) == (
        [2], "P = 4, 8, 16 left out (more than the 2 usable cores; --max-procs, or --nprocs "
             "2,4,8,16 to oversubscribe)")
    assert scaling.choose_nprocs([2, 4], None, cores) == ([2, 4], None)   # asked: oversubscribe
    assert scaling.choose_nprocs(None, 8, cores) == ([2, 4, 8], "P = 16 left out (--max-procs 8)")
    assert scaling.choose_nprocs(None, None, 64) == ([2, 4, 8, 16], None)
    with pytest.raises(scaling.BenchError, match="no process count left"):
        scaling.choose_nprocs([4], 2, cores)
    assert scaling.parse_nprocs("4, 2,4") == [2, 4]
    for bad in ("0", "2,x", ""):
        with pytest.raises(ValueError):
            scaling.parse_nprocs(bad)
    assert scaling.parse_collectives("reduce-scatter,allreduce") == ["allreduce",
                                                                     "reduce_scatter"]
    with pytest.raises(ValueError, match="choose from"):
        scaling.parse_collectives("allscatter")
    assert scaling.parse_collectives("scan,alltoall") == ["alltoall", "scan"]


def test_scaling_measures_through_compare(monkeypatch, capsys):
    """Each (P, collective) is one compare.run_all of shmtree, shared, mpi and mpi_shared, with
    the sizes rounded as compare rounds them (allgather at P=3: whole blocks)."""
    calls = []

    def fake(sizes, nprocs, plan, options, methods, pythons, progress, collective):
        calls.append((nprocs, collective, list(sizes), list(methods)))
        def us(t):
            return {s: {"median_s": t * 1e-6, "min_s": 1e-6, "iters": 2} for s in sizes}
        return ([compare.Column("shmtree", "shmtree", us(10 * nprocs)),
                 compare.Column("shared", "shmtree shared", us(nprocs)),
                 compare.Column("mpi0", "MPICH 9", us(30 * nprocs), detail="MPICH 9; x; p"),
                 compare.Column("mpi_shared0", "MPICH 9 shared", us(5 * nprocs),
                                detail="MPICH 9; y; p")],
                compare.Column("copy", "copy", us(1)))
    monkeypatch.setattr(compare, "run_all", fake)
    monkeypatch.setattr(scaling.mpi, "probe", lambda python: (None, None))
    assert main(["scaling", "--nprocs", "3,2", "--sizes", "8", "--iters", "1",
                 "--collectives", "allgather"]) == 0
    assert calls == [(2, "allgather", [8], ["shmtree", "shared", "mpi", "mpi_shared"]),
                     (3, "allgather", [12], ["shmtree", "shared", "mpi", "mpi_shared"])]
    out = capsys.readouterr().out
    header, rows = _table(out)
    assert "MPICH 9 (us)" in header and "# MPI: MPICH 9 (python" in out
    assert [(r[0], r[4], r[5], r[6], r[7]) for r in rows] == [
        ("2", "private", "20", "60", "3x"), ("2", "shared", "2", "10", "5x"),
        ("3", "private", "30", "90", "3x"), ("3", "shared", "3", "15", "5x")], rows
    assert "P=3 allgather: --sizes rounded" in out
