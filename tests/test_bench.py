"""End-to-end tests of shmtree-bench, with tiny sizes and fixed iteration counts.

The first group needs nothing but numpy: size parsing, tables and files, the fork harness and its
cleanup, the copy limit, the numpy/Pipe baselines, the NUMA matrix, and ``compare`` without the
shmtree column.  The second group runs every command end to end through shmtree (skipped only
when shmtree's compiled extension cannot be imported at all).  MPI and gloo columns are checked
when mpi4py / torch are installed.  Every multi-process test checks that nothing is left in
/dev/shm and no child process is left running.
"""
import importlib
import importlib.util
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from shmtree.bench import baselines, copylimit, harness, machine, numa, report, units
from shmtree.bench.__main__ import main
from shmtree.bench.cli import parse
from shmtree.bench.measure import Buffers, Plan, expected, iteration_counts

TINY = ["--sizes", "8,4K", "-n", "2", "--iters", "2"]
META_KEYS = {"tool", "schema", "command", "host", "date", "cpu_model", "topology",
             "shmtree_version", "options", "columns", "rows", "numa_nodes"}


def _shmtree_importable():
    try:
        import shmtree
        return callable(shmtree.run)
    except (ImportError, AttributeError):
        return False


needs_shmtree = pytest.mark.skipif(not _shmtree_importable(), reason="shmtree not built")
timeout = pytest.mark.timeout(120)


# segments the bench's own processes could leave: shared_memory's, MPICH's, Open MPI's, shmtree's
# (other names come and go with whatever else runs on the machine, e.g. semaphores)
OURS = ("psm_", "wnsm_", "mpich_shm_", "sm_segment.", "vader_segment.", "shmtree")


def _segments():
    return {name for name in os.listdir("/dev/shm") if name.startswith(OURS)}


@pytest.fixture(autouse=True)
def no_leftovers():
    """Nothing new of ours in /dev/shm and no live child process after each test (an entry
    held only by processes outside this test's tree is another job's MPI run on the same
    machine: conftest.split_foreign, a warning there)."""
    from conftest import split_foreign
    before = _segments()
    yield
    assert multiprocessing.active_children() == []
    leaked, _ = split_foreign(sorted(_segments() - before))
    assert leaked == []


@pytest.fixture(autouse=True)
def keep_signal_handlers():
    """main() makes SIGTERM raise KeyboardInterrupt in the process that runs it (the test
    process here): give the test process its handlers back.  A Python-level SIGTERM handler left
    behind is inherited by the pool workers later tests fork, and multiprocessing's terminate()
    (SIGTERM) can then hang on a worker whose main thread never runs the handler."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        if handler is not None:
            signal.signal(sig, handler)


def _json(tmp_path, argv):
    path = tmp_path / "out.json"
    assert main(argv + ["--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert META_KEYS <= set(doc) and doc["tool"] == "shmtree-bench"
    return doc


# --- without shmtree --------------------------------------------------------------------------

@timeout
def test_sizes_parse_and_format():
    assert units.parse_sizes("8,1K,64M") == [8, 1024, 64 << 20]
    assert units.parse_sizes("8:64M:x8") == [8, 64, 512, 4096, 32768, 262144, 2 << 20,
                                             16 << 20, 64 << 20]
    assert units.parse_sizes("1.5K, 2MiB") == [1536, 2 << 20]
    assert units.format_size(64 << 20) == "64 MiB" and units.format_size(1536) == "1.5 KiB"
    for bad in ("", "abc", "8:4:x2", "1:8:2", "0.5"):
        with pytest.raises(ValueError):
            units.parse_sizes(bad)


@timeout
def test_default_command_is_the_allreduce_sweep():
    args = parse([])
    assert args.command == "allreduce" and args.sizes[0] == 8 and args.sizes[-1] == 64 << 20
    assert args.nprocs is None and args.dtype == np.float32 and args.op == "sum"
    assert parse(["--sizes", "1K"]).command == "allreduce"
    with pytest.raises(SystemExit):
        parse(["allreduce", "--op", "mean"])


def test_bench_op_table_is_shmtrees():
    """The bench's ops (units.OPS, measure.UFUNCS) are shmtree's, by name and by ufunc, and every
    dtype the bench parses by its usual name is one shmtree reduces."""
    from shmtree import _kernels as K
    from shmtree.bench import measure
    assert units.OPS == tuple(measure.UFUNCS)
    for name, ufunc in measure.UFUNCS.items():
        assert K.OP_CODES[name] == K.UFUNC_CODES[ufunc], name
    for name in ("bool", "int8", "uint64", "float16", "float32", "float64", "complex128"):
        assert units.parse_dtype(name).str[1:] in K.DTYPE_CODES, name


@timeout
def test_console_script_entry_point():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as f:
        target = tomllib.load(f)["project"]["scripts"]["shmtree-bench"]
    module, _, name = target.partition(":")
    assert getattr(importlib.import_module(module), name) is main


@timeout
def test_measure_helpers():
    assert iteration_counts(1e-3, target_s=0.2) == (20, 200)
    assert iteration_counts(10.0)[1] == 3 and iteration_counts(1e-3, iters=7)[1] == 7
    bufs = Buffers(10, "int32", rank=2, fresh=True, rotation_bytes=1 << 20)
    assert len(bufs) >= 256 and bufs.pair(3)[0][0] == 3 and bufs.pair(3)[0].shape == (10,)
    assert expected("sum", np.dtype("int8"), 16) == np.int8(136 - 256)
    assert expected("max", np.dtype("float32"), 4) == 4
    assert expected("prod", np.dtype("f8"), 4) == 24


@timeout
def test_table_json_csv(tmp_path):
    text = report.table(["a", "bb"], [["1", "22"], ["333", "4"]])
    assert text.splitlines()[1] == "---  --" and text.splitlines()[2] == "  1  22"
    rows = [{"size": 8, "time_us": np.float64(1.5)}, {"size": 16, "time_us": None}]
    doc = report.document("x", machine.describe(), {"o": 1}, {"size": "bytes"}, rows)
    report.write_json(tmp_path / "r.json", doc)
    assert json.loads((tmp_path / "r.json").read_text())["rows"][0]["time_us"] == 1.5
    report.write_csv(tmp_path / "r.csv", ["size", "time_us"], rows)
    assert (tmp_path / "r.csv").read_text().splitlines() == ["size,time_us", "8,1.5", "16,"]
    assert sorted(os.listdir(tmp_path)) == ["r.csv", "r.json"]  # no temporary files left


def _boom(peer):
    if peer.rank == 1:
        raise ValueError("boom")
    peer.barrier()


def _die(peer):
    if peer.rank == 0:
        os._exit(3)
    peer.barrier()


@timeout
def test_harness_reports_failures_and_cleans_up():
    assert harness.launch(lambda peer: (peer.rank, peer.max(peer.rank * 1.0)), 3) == \
        [(0, 2.0), (1, 2.0), (2, 2.0)]
    with pytest.raises(harness.BenchError, match="rank 1 failed: ValueError: boom"):
        harness.launch(_boom, 2)
    with pytest.raises(harness.BenchError, match=r"rank 0 died \(exit code 3\)"):
        harness.launch(_die, 2)


def _max_many(peer):
    wrong = 0
    for i in range(300):
        value = float((7 * i + 13 * peer.rank) % 101)
        wrong += peer.max(value) != max(float((7 * i + 13 * r) % 101) for r in range(peer.size))
    return wrong


@timeout
def test_harness_barrier_holds_call_after_call():
    """Peer.max is right in every one of many calls, also with more ranks than cores: the
    barrier lets no rank overwrite its slot before every rank has read the last round."""
    assert harness.launch(_max_many, 3) == [0, 0, 0]
    assert harness.launch(_max_many, 5, pin=False) == [0] * 5


@timeout
def test_copy_limit_and_hand_written_baselines():
    plan = Plan(iters=2)
    for run in (copylimit.run_copy, baselines.run_numpy_shm, baselines.run_pipe):
        result = run([8, 4096], 2, plan)
        assert sorted(result) == [8, 4096]
        assert all(r["median_s"] > 0 and r["iters"] == 2 for r in result.values())
    for op, dtype in (("max", "int16"), ("prod", "float64"), ("sum", "bool")):
        assert baselines.run_pipe([24], 3, Plan(dtype=dtype, op=op, iters=2))[24]["iters"] == 2
        assert baselines.run_numpy_shm([24], 3, Plan(dtype=dtype, op=op, iters=2))


@timeout
def test_numa_matrix_runs_on_every_node():
    mat = numa.matrix(1 << 20, Plan(iters=2))
    n = len(mat["nodes"])
    assert n >= 1 and len(mat["read_gbs"]) == n and all(len(r) == n for r in mat["write_gbs"])
    assert all(v > 0 for line in mat["read_gbs"] for v in line)
    assert mat["pages_by_node"][0][0]  # numa_maps was found for the shared buffer
    assert (numa.one_node_note(mat) is not None) == (n == 1)


@timeout
def test_compare_without_shmtree(tmp_path):
    doc = _json(tmp_path, ["compare", "--methods", "copy,numpy-shm,pipe"] + TINY)
    assert [r["size"] for r in doc["rows"]] == [8, 4096]
    assert all(r["numpy_shm_us"] > 0 and r["pipe_us"] > 0 and r["copy_us"] > 0
               for r in doc["rows"])
    assert set(doc["methods"]) == {"numpy_shm", "pipe", "copy"}


@timeout
def test_compare_csv_progress_and_missing_interpreter(tmp_path, capsys):
    csv_path = tmp_path / "c.csv"
    argv = ["compare", "--methods", "copy,mpi", "--mpi-python", "/nonexistent/python",
            "--progress", "--csv", str(csv_path)] + TINY
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "n/a (no such interpreter)" in out and "[2/2] compare" in err
    header, *lines = csv_path.read_text().splitlines()
    assert header.split(",")[:2] == ["size", "count"] and "copy_us" in header and len(lines) == 2


@timeout
def test_plot_without_matplotlib_says_so(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["compare", "--methods", "copy", "--plot", "x.png"] + TINY) == 1
    assert "needs matplotlib" in capsys.readouterr().err
    assert not os.path.exists("x.png")


@timeout
def test_plot_written(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "c.png"
    assert main(["compare", "--methods", "copy,pipe", "--plot", str(png)] + TINY) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@timeout
def test_mpi_and_gloo_columns(tmp_path):
    have_mpi = importlib.util.find_spec("mpi4py") is not None
    have_torch = importlib.util.find_spec("torch") is not None
    doc = _json(tmp_path, ["compare", "--methods", "mpi,gloo"] + TINY)
    status = {m["label"] if m["status"] == "ok" else k: m["status"]
              for k, m in doc["methods"].items()}
    assert (doc["methods"]["mpi0"]["status"] == "ok") == have_mpi, status
    assert doc["methods"]["gloo"]["status"] == ("ok" if have_torch else "n/a (not installed)")
    if have_mpi:
        assert all(r["mpi0_us"] > 0 for r in doc["rows"])


# --- end to end through shmtree ---------------------------------------------------------------

@needs_shmtree
@timeout
def test_allreduce_sweep(tmp_path):
    doc = _json(tmp_path, ["allreduce", "--csv", str(tmp_path / "s.csv")] + TINY)
    assert doc["command"] == "allreduce" and [r["size"] for r in doc["rows"]] == [8, 4096]
    for r in doc["rows"]:
        assert r["time_us"] > 0 and r["copy_us"] > 0 and r["iters"] == 2
        assert r["busbw_gbs"] == pytest.approx(r["algbw_gbs"])  # 2(P-1)/P = 1 for P = 2
    assert (tmp_path / "s.csv").read_text().startswith("size,count,time_us")


@needs_shmtree
@timeout
def test_allreduce_options_and_module_entry(tmp_path):
    path = tmp_path / "o.json"
    argv = ["allreduce", "--sizes", "4K", "-n", "3", "--iters", "2", "--dtype", "int64",
            "--op", "max", "--tree", "chain", "--chunk-bytes", "1K", "--fresh", "--no-pin",
            "--json", str(path)]
    proc = subprocess.run([sys.executable, "-m", "shmtree.bench"] + argv, capture_output=True,
                          text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    assert "busbw (GB/s)" in proc.stdout and "4 KiB" in proc.stdout
    doc = json.loads(path.read_text())
    assert doc["options"]["group_options"] == {"tree": "chain", "chunk_bytes": 1024, "pin": False}
    assert doc["options"]["plan"]["fresh"] and doc["rows"][0]["count"] == 512


@needs_shmtree
@timeout
def test_compare_all_methods(tmp_path, capsys):
    doc = _json(tmp_path, ["compare"] + TINY)
    out = capsys.readouterr().out
    assert "shmtree (us)" in out and "shmtree/copy" in out
    assert doc["methods"]["shmtree"]["status"] == "ok"
    for r in doc["rows"]:
        assert r["shmtree_us"] > 0 and r["shmtree_vs_copy"] > 0
        assert r["pipe_vs_shmtree"] == pytest.approx(r["pipe_us"] / r["shmtree_us"])


@needs_shmtree
@timeout
def test_numa_report(tmp_path, capsys):
    doc = _json(tmp_path, ["numa", "--matrix-size", "1M"] + TINY)
    assert len(doc["matrix"]["read_gbs"]) == len(doc["matrix"]["nodes"])
    assert {(r["group"], r["variant"]) for r in doc["rows"]} == set(numa.VARIANTS)
    assert "read: np.copyto(local, remote)" in capsys.readouterr().out


@needs_shmtree
@timeout
def test_numa_reports_the_single_copy_path_beside_the_copy_path(tmp_path, capsys, monkeypatch):
    from shmtree.bench import sweep
    calls = []
    real = sweep.run_shared

    def spy(sizes, nprocs, plan, options, collective="allreduce"):
        calls.append((list(sizes), nprocs, collective))
        return real(sizes, nprocs, plan, options, collective)
    monkeypatch.setattr(sweep, "run_shared", spy)
    doc = _json(tmp_path, ["numa", "--quick", "-n", "2", "--sizes", "1M"])
    out = capsys.readouterr().out
    assert calls == [([1 << 20], 2, "allreduce")]           # shared arrays: the single copy
    header = next(line.split() for line in out.splitlines() if "tree=chain" in line)
    assert header[:3] == ["size", "arrays=private", "arrays=shared"], header
    rows = {(r["group"], r["variant"]): r for r in doc["rows"]}
    for variant in ("private", "shared"):
        row = rows[("arrays", variant)]
        assert "error" not in row and row["time_us"] > 0 and row["size"] == 1 << 20, row


# (command-line options, the same options as shmtree.Group keywords)
PLAN_CASES = [
    (["-n", "1"], {}),
    (["-n", "4"], {}),
    (["-n", "4", "--tree", "auto"], {"tree": "auto"}),
    (["-n", "4", "--tree", "chain", "--chunk-bytes", "64K", "--slots", "3"],
     {"tree": "chain", "chunk_bytes": 64 << 10, "slots": 3}),
    (["-n", "4", "--tree", "ring", "--small-bytes", "1K"], {"tree": "ring", "small_bytes": 1024}),
    (["-n", "4", "--tree", "3", "--nt-bytes", "0", "--spin-us", "5"],
     {"tree": 3, "nt_bytes": 0, "spin_us": 5.0}),
    (["-n", "16", "--topology", "2x4", "--tree", "binary", "--placement", "spread"],
     {"topology": "2x4", "tree": "binary", "placement": "spread"}),
    (["-n", "16", "--topology", "2x2x4"], {"topology": "2x2x4"}),
    (["-n", "16", "--topology", "2x2x4", "--tree", "flat", "--no-pin", "--numa", "producer"],
     {"topology": "2x2x4", "tree": "flat", "pin": False, "numa": "producer"}),
    (["-n", "8", "--topology", "2x4", "--tree", "ring"], {"topology": "2x4", "tree": "ring"}),
    (["--topology", "2x4"], {"topology": "2x4"}),     # -n defaults to the topology's cores
]


def _group_plan(argv, options):
    """shmtree.Group's own plan for these options (the Group is made here, then closed)."""
    import shmtree
    n = int(argv[argv.index("-n") + 1]) if "-n" in argv else \
        shmtree.Topology.resolve(options["topology"]).ncpus
    group = shmtree.Group(n, **options)
    try:
        return group.plan
    finally:
        group.close()


@needs_shmtree
@timeout
@pytest.mark.parametrize("argv, options", PLAN_CASES, ids=[" ".join(a) for a, _ in PLAN_CASES])
def test_topology_prints_the_groups_own_plan(argv, options, capsys):
    """The bench prints exactly what the Group runs: they cannot disagree."""
    import shmtree
    assert main(["topology"] + argv) == 0
    out = capsys.readouterr().out
    plan = _group_plan(argv, options)
    summary = shmtree.Topology.resolve(options.get("topology")).describe()
    assert out == f"{summary}\n\n{plan.describe()}\n"


@needs_shmtree
@timeout
def test_topology_json_is_the_groups_plan(tmp_path):
    argv = ["-n", "16", "--topology", "2x2x4", "--tree", "ring", "--chunk-bytes", "128K",
            "--small-bytes", "2K"]
    options = {"topology": "2x2x4", "tree": "ring", "chunk_bytes": 128 << 10,
               "small_bytes": 2048}
    doc = _json(tmp_path, ["topology"] + argv)
    plan, got = _group_plan(argv, options), doc["plan"]
    assert got["small_tree"]["parent"] == list(plan.small_tree.parent)
    assert got["large_tree"]["parent"] == list(plan.large_tree.parent)
    assert got["small_tree"]["kind"] == plan.small_tree.kind
    assert got["large_tree"]["kind"] == plan.large_tree.kind
    assert got["large_schedule"] == plan.large_schedule == "ring"
    assert got["ring_order"] == list(plan.large_tree.ring)
    assert (got["chunk_bytes"], got["slots"], got["small_bytes"]) == \
        (plan.chunk_bytes, plan.slots, plan.small_bytes) == (128 << 10, max(plan.slots, 2), 2048)
    assert got["digest"] == plan.digest().hex() and got["describe"] == plan.describe()
    assert doc["options"]["group_options"] == options and doc["options"]["nprocs"] == 16


@needs_shmtree
@timeout
def test_topology_refuses_what_the_group_refuses(capsys):
    assert main(["topology", "-n", "4", "--chunk-bytes", "8"]) == 1
    assert "chunk_bytes must be an int >= 64" in capsys.readouterr().err


@timeout
def test_version(capsys):
    from shmtree._version import __version__
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out == f"shmtree-bench {__version__}\n"


@timeout
def test_sizes_must_be_positive(capsys):
    for bad in ("0", "8,0", "0K", "-8", "0:8:x2"):
        with pytest.raises(ValueError):
            units.parse_sizes(bad)
        with pytest.raises(SystemExit) as stop:
            parse(["allreduce", f"--sizes={bad}"])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert "argument --sizes:" in err and ("at least 1 byte" in err or "negative" in err
                                               or "0 < START" in err), err
    with pytest.raises(SystemExit):
        parse(["numa", "--matrix-size", "0"])
    assert parse(["--sizes", "1"]).sizes == [1]


@timeout
@pytest.mark.parametrize("argv, codes", [(["topology", "-n", "16", "--topology", "2x2x4"], {141}),
                                         (["--help"], {0, 141})])
def test_closed_pipe_ends_quietly(argv, codes):
    """`shmtree-bench ... | head -1`: the reader is gone before the output is written.  Exit
    141 (128 + SIGPIPE); argparse's --help drops a failed write itself and may exit 0."""
    proc = subprocess.Popen([sys.executable, "-m", "shmtree.bench"] + argv,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()          # before the interpreter has even started: every write fails
    with proc.stderr:
        err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) in codes, err
    assert err == ""             # no traceback, no "Exception ignored ... BrokenPipeError"


@timeout
def test_compare_without_mpi_says_how_to_get_it(tmp_path, capsys):
    if importlib.util.find_spec("mpi4py") is not None:
        pytest.skip("mpi4py is installed here")
    doc = _json(tmp_path, ["compare", "--methods", "mpi"] + TINY)
    out = capsys.readouterr().out
    assert "n/a (not installed)" in out
    [line] = [l for l in out.splitlines() if l.startswith("# MPI:")]
    assert 'pip install "shmtree[mpi]"' in line and "mpi4py mpich" in line
    assert "--mpi-python PATH" in line
    assert 'pip install "shmtree[mpi]"' in doc["methods"]["mpi0"]["hint"]


@timeout
def test_mpi_probe_names_the_missing_piece(tmp_path, monkeypatch):
    from shmtree.bench import mpi

    def fake(name, script):
        path = tmp_path / name
        path.write_text("#!/bin/sh\n" + script)
        path.chmod(0o755)
        return str(path)

    status, hint = mpi.probe(fake("nolib", "echo 'RuntimeError: cannot load MPI library' >&2\n"
                                           "exit 1\n"))
    assert status == "n/a (no MPI library)" and "cannot load MPI library" in hint
    assert "pip install mpich" in hint and "--mpi-python PATH" in hint
    status, hint = mpi.probe(fake("nompi4py", "echo mpi4py\nexit 3\n"))
    assert status == "n/a (not installed)" and "-m pip install numpy mpi4py mpich" in hint
    monkeypatch.setattr(mpi.shutil, "which", lambda name: None)
    status, hint = mpi.probe(fake("noexec", "exit 0\n"))
    assert status == "n/a (no mpiexec)" and "pip install mpich" in hint
    assert mpi.probe("/nonexistent/python")[0] == "n/a (no such interpreter)"


@needs_shmtree
@timeout
def test_numa_quick(tmp_path, capsys):
    started = time.monotonic()
    doc = _json(tmp_path, ["numa", "--quick", "-n", "2"])
    elapsed = time.monotonic() - started
    out = capsys.readouterr().out
    assert out.startswith("# --quick: 32 KiB only, 1 MiB matrix cells")
    assert doc["options"]["quick"] is True and doc["options"]["sizes"] == [32 << 10]
    assert doc["options"]["plan"]["target_s"] == 0.02 and doc["matrix"]["size"] == 1 << 20
    assert {r["size"] for r in doc["rows"]} == {32 << 10}
    assert {(r["group"], r["variant"]) for r in doc["rows"]} == set(numa.VARIANTS)
    assert elapsed < 30, elapsed       # about 2 s on the 2-core CI machine
    with pytest.raises(SystemExit):
        main(["numa", "--help"])
    assert "--quick, --short" in capsys.readouterr().out


@needs_shmtree
@timeout
def test_reproduce_quick(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "..", "bench", "reproduce.py")
    proc = subprocess.run([sys.executable, script, "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode in (0, 1), proc.stderr
    [path] = [p for p in tmp_path.iterdir() if p.suffix == ".json"]
    doc = json.loads(path.read_text())
    assert set(doc["sections"]) == {"allreduce", "compare", "numa"} and doc["quick"] is True
    assert doc["exit_codes"]["allreduce"] == 0 and doc["sections"]["allreduce"]["rows"]


# --- compare --collective ------------------------------------------------------------------

COLLECTIVES = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter")
NEW = ("alltoall", "alltoallv", "gather", "scatter", "scan", "exscan")   # the complete set
ALL = COLLECTIVES + NEW                                                  # (DESIGN 11)
TITLES = {"broadcast": "broadcast (root 0)", "reduce": "reduce (root 0)",
          "gather": "gather (root 0)", "scatter": "scatter (root 0)",
          "alltoallv": "alltoallv (alltoall with counts=)"}


def _has_calls():
    try:
        import shmtree
        from shmtree.bench.compare import CALLS
        return all(hasattr(shmtree.Communicator, CALLS.get(c, c))
                   for c in NEW + ("allreduce_init",))
    except (ImportError, AttributeError):
        return False


needs_calls = pytest.mark.skipif(not _has_calls(), reason="this shmtree has no comm.alltoall, "
                                 "gather, scatter, scan, exscan, allreduce_init")


def _shmtree_case(collective):
    """A parameter that needs shmtree's call for `collective` (skipped without it)."""
    return pytest.param(collective, marks=needs_calls) if collective in NEW else collective


def _mpi_python():
    """An interpreter with mpi4py for the MPI parts: $SHMTREE_TEST_MPI_PYTHON (e.g. the python of
    a venv with numpy mpi4py mpich), else this one if it has mpi4py, else None (skip)."""
    other = os.environ.get("SHMTREE_TEST_MPI_PYTHON")
    if other:
        return other
    return sys.executable if importlib.util.find_spec("mpi4py") is not None else None


@timeout
def test_compare_collective_option_parses(capsys):
    assert parse(["compare"]).collective == "allreduce"
    for name in ALL:
        assert parse(["compare", "--collective", name]).collective == name
    assert parse(["compare", "--collective=reduce_scatter"] + TINY).methods is None
    for bad in (["compare", "--collective", "allscatter"], ["allreduce", "--collective", "reduce"]):
        with pytest.raises(SystemExit) as stop:
            parse(bad)
        assert stop.value.code == 2
    assert "invalid choice: 'allscatter'" in capsys.readouterr().err


@timeout
def test_collective_layouts_are_whole_buffers():
    """A size is the whole buffer (nccl-tests): allgather's result, reduce_scatter's input, of P
    equal blocks rounded down to whole items, at least one item each."""
    from shmtree.bench.compare import methods_for
    from shmtree.bench.measure import layout, whole_bytes
    assert layout("allreduce", 4096, "float32", 4) == (1024, 1024)
    assert layout("broadcast", 4096, "float32", 4) == layout("reduce", 4096, "float32", 4)
    assert layout("allgather", 4096, "float32", 4) == (256, 1024)
    assert layout("reduce_scatter", 4096, "float32", 4) == (1024, 256)
    assert layout("allgather", 1 << 20, "float32", 3) == (87381, 262143)
    assert layout("reduce_scatter", 8, "float64", 4) == (4, 1)      # one item per block at least
    assert whole_bytes("allgather", 8, "float32", 4) == 16
    assert layout("alltoall", 4096, "float32", 4) == (1024, 1024)
    assert layout("alltoall", 1 << 20, "float32", 3) == (262143, 262143)
    assert layout("alltoallv", 1 << 20, "float32", 3) == (262143, 262143)   # (alltoall's)
    assert layout("gather", 4096, "float32", 4) == (256, 1024)
    assert layout("scatter", 4096, "float32", 4) == (1024, 256)
    assert layout("scan", 4096, "float32", 4) == layout("exscan", 4096, "float32", 4) == \
        (1024, 1024)
    assert whole_bytes("alltoall", 8, "float64", 4) == 32 and whole_bytes("scan", 8, "int8",
                                                                             4) == 8
    with pytest.raises(ValueError, match="unknown collective"):
        layout("allscatter", 8, "float32", 2)
    from shmtree.bench.compare import default_methods
    assert methods_for("allreduce") == ("shmtree", "shared", "copy", "numpy_shm", "pipe", "mpi",
                                        "mpi_shared", "gloo")
    assert default_methods("allreduce") == ("shmtree", "copy", "numpy_shm", "pipe", "mpi",
                                            "gloo")
    assert default_methods("allreduce", shared=True) == methods_for("allreduce")
    for name in ALL[1:]:
        assert default_methods(name) == ("shmtree", "copy", "mpi")
        assert default_methods(name, shared=True) == ("shmtree", "shared", "copy", "mpi",
                                                      "mpi_shared")
        assert methods_for(name) == ("shmtree", "shared", "copy", "mpi", "mpi_shared")
    assert units.format_size(1048572) == "1048572 B" and units.format_size(1280) == "1.25 KiB"


@timeout
def test_collective_checks_catch_wrong_results():
    from shmtree.bench.measure import check, fill, layout
    for name in ALL:
        n_in, n_out = layout(name, 64, "int32", 2)
        bufs = Buffers(n_in, "int32", rank=1, out_count=n_out)
        with pytest.raises(RuntimeError, match=f"wrong {name} result"):
            check(name, "sum", 0 if name in ("reduce", "gather") else 1, 2, bufs, "test")
    # alltoall (and alltoallv, its counts= form of equal blocks): block s of rank r's result is
    # block r of rank s's input (a tag per pair), so a block from the wrong rank, or the wrong
    # block of the right rank, is caught
    P = 3
    for name in ("alltoall", "alltoallv"):
        sent = []
        for r in range(P):
            b = Buffers(3 * P, "int16", rank=r, out_count=3 * P)
            fill(name, r, P, b.inputs)
            sent.append(b.inputs[0].reshape(P, 3))
        assert len({int(sent[r][d][0]) for r in range(P) for d in range(P)}) == P * P
        for r in range(P):
            bufs = Buffers(3 * P, "int16", rank=r, out_count=3 * P)
            got = bufs.outputs[0].reshape(P, 3)
            got[:] = [sent[s][r] for s in range(P)]
            check(name, "sum", r, P, bufs, "test")
            got[[0, 1]] = got[[1, 0]]
            with pytest.raises(RuntimeError, match="block 0"):
                check(name, "sum", r, P, bufs, "test")
            got[:] = [sent[s][(r + 1) % P] for s in range(P)]
            with pytest.raises(RuntimeError, match=f"wrong {name} result"):
                check(name, "sum", r, P, bufs, "test")
    # scatter: the root's block d holds d + 1, rank r gets r + 1; gather: the root's block r
    # holds r + 1; scan: 1 + ... + (r + 1); exscan: 1 + ... + r, rank 0 unchecked (MPI leaves
    # it undefined)
    root = Buffers(2 * P, "float32", rank=0, out_count=2)
    fill("scatter", 0, P, root.inputs)
    assert root.inputs[0].tolist() == [1, 1, 2, 2, 3, 3]
    other = Buffers(2 * P, "float32", rank=1, out_count=2)
    fill("scatter", 1, P, other.inputs)
    assert other.inputs[0].tolist() == [2] * 6                     # (unused away from the root)
    other.outputs[0][:] = 2
    check("scatter", "sum", 1, P, other, "test")
    g = Buffers(2, "float32", rank=0, out_count=2 * P)
    g.outputs[0][:] = [1, 1, 2, 2, 3, 3]
    check("gather", "sum", 0, P, g, "test")
    check("gather", "sum", 1, P, Buffers(2, "float32", rank=1, out_count=2 * P), "test")
    for rank, scan, exscan in ((0, 1, None), (1, 3, 1), (2, 6, 3)):
        b = Buffers(4, "int64", rank=rank)
        b.outputs[0][:] = scan
        check("scan", "sum", rank, P, b, "test")
        if exscan is None:
            check("exscan", "sum", rank, P, b, "test")       # rank 0: anything goes
        else:
            b.outputs[0][:] = exscan
            check("exscan", "sum", rank, P, b, "test")
            b.outputs[0][:] = scan
            with pytest.raises(RuntimeError, match="wrong exscan result"):
                check("exscan", "sum", rank, P, b, "test")
    bufs = Buffers(4, "int32", rank=0, out_count=8)       # allgather, P = 2, rank 0 (inputs = 1)
    bufs.outputs[0][:] = [1, 1, 1, 1, 2, 2, 2, 2]
    check("allgather", "sum", 0, 2, bufs, "test")
    check("broadcast", "sum", 0, 2, bufs, "test")            # in place: rank 0's own 1s
    check("reduce", "sum", 1, 2, Buffers(4, "int32", rank=1), "test")   # not the root: no result


@timeout
def test_compare_collective_refuses_allreduce_only_methods(capsys):
    assert main(["compare", "--collective", "broadcast", "--methods", "shmtree,pipe"] + TINY) == 1
    err = capsys.readouterr().err
    assert "['pipe'] do not measure broadcast" in err
    assert "'shmtree', 'shared', 'copy', 'mpi'" in err


@timeout
@pytest.mark.parametrize("collective", ALL[1:])
def test_compare_collective_copy_without_shmtree(tmp_path, collective):
    """The standalone copy (no shmtree column) copies each size's whole buffer."""
    from shmtree.bench.measure import BLOCKED
    doc = _json(tmp_path, ["compare", "--collective", collective, "--methods", "copy",
                           "--sizes", "8,4K", "-n", "4", "--iters", "2"])
    rows = {4: 16, 4096: 4096} if collective in BLOCKED else {8: 8, 4096: 4096}
    assert [r["size"] for r in doc["rows"]] == list(rows.values())
    assert all(r["copy_us"] > 0 for r in doc["rows"]) and doc["collective"] == collective


@needs_shmtree
@timeout
@pytest.mark.parametrize("collective", [_shmtree_case(c) for c in ALL])
def test_compare_collective_runs_for_shmtree(tmp_path, capsys, collective):
    from shmtree.bench.measure import MOVES_ONLY
    from shmtree.bench.compare import DETAILS
    doc = _json(tmp_path, ["compare", "--collective", collective, "--methods", "shmtree,copy"]
                + TINY)
    out = capsys.readouterr().out
    title = TITLES.get(collective, collective)
    assert f" compare {title}: 2 processes, float32" in out.splitlines()[0]
    assert ("float32 sum" in out.splitlines()[0]) == (collective not in MOVES_ONLY)
    assert "shmtree (us)" in out and "shmtree/copy" in out
    assert doc["collective"] == collective and doc["options"]["collective"] == collective
    assert doc["methods"]["shmtree"] == {"label": "shmtree", "status": "ok",
                                         "detail": DETAILS.get(collective,
                                                               f"comm.{collective}")}
    assert [(r["size"], r["count"]) for r in doc["rows"]] == [(8, 2), (4096, 1024)]
    for r in doc["rows"]:
        assert r["shmtree_us"] > 0 and r["copy_us"] > 0 and r["shmtree_vs_copy"] > 0


@needs_shmtree
@timeout
@pytest.mark.parametrize("collective", ["allgather", "reduce_scatter"])
def test_compare_collective_uneven_and_fresh(tmp_path, collective):
    """P = 3 does not divide 4 KiB: the rows say the bytes measured; --fresh rotates (P, block)
    views too; int64 max."""
    doc = _json(tmp_path, ["compare", "--collective", collective, "--methods", "shmtree",
                           "--sizes", "4K", "-n", "3", "--iters", "2", "--fresh",
                           "--dtype", "int64", "--op", "max"])
    assert doc["rows"][0]["size"] == 4080 and doc["rows"][0]["count"] == 510
    assert doc["rows"][0]["shmtree_us"] > 0


@timeout
@pytest.mark.parametrize("collective", ALL)
def test_compare_collective_mpi(tmp_path, collective):
    python = _mpi_python()
    if python is None:
        pytest.skip("mpi4py is not installed (set SHMTREE_TEST_MPI_PYTHON to a python with it)")
    from shmtree.bench.mpi_worker import FUNCTIONS
    doc = _json(tmp_path, ["compare", "--collective", collective, "--methods", "mpi",
                           "--mpi-python", python] + TINY)
    meta = doc["methods"]["mpi0"]
    assert meta["status"] == "ok", meta
    assert f"MPI_{FUNCTIONS[collective]};" in meta["detail"] and doc["collective"] == collective
    assert all(r["mpi0_us"] > 0 for r in doc["rows"])


@timeout
def test_shared_adds_the_shared_twin_of_each_given_method():
    from shmtree.bench.compare import with_shared
    assert with_shared(["shmtree", "copy", "mpi"], True) == ["shmtree", "shared", "copy", "mpi",
                                                             "mpi_shared"]
    assert with_shared(["shmtree", "copy", "mpi"], False) == ["shmtree", "copy", "mpi"]
    assert with_shared(["shared", "shmtree", "mpi_shared"], True) == ["shared", "shmtree",
                                                                      "mpi_shared"]
    assert parse(["compare", "--shared", "--methods", "mpi"]).shared


@timeout
@pytest.mark.parametrize("collective, nprocs", [(c, 2) for c in ALL]
                         + [("allreduce", 3), ("reduce_scatter", 3), ("allgather", 3),
                            ("alltoall", 3), ("alltoallv", 3), ("scatter", 3), ("exscan", 3)])
def test_compare_mpi_on_allocate_shared_memory(tmp_path, collective, nprocs):
    """The MPI column on MPI.Win.Allocate_shared memory: the single copy, checked, then timed
    (P = 3: parts and blocks that do not divide the sizes)."""
    python = _mpi_python()
    if python is None:
        pytest.skip("mpi4py is not installed (set SHMTREE_TEST_MPI_PYTHON to a python with it)")
    doc = _json(tmp_path, ["compare", "--collective", collective, "--methods", "mpi_shared",
                           "--mpi-python", python, "--sizes", "8,4K,300K", "-n", str(nprocs),
                           "--iters", "2", "--dtype", "int64", "--op", "max"])
    meta = doc["methods"]["mpi_shared0"]
    assert meta["status"] == "ok", meta
    assert "MPI_Win_allocate_shared" in meta["detail"] and meta["label"].endswith(" shared")
    assert list(doc["methods"]) == ["mpi_shared0"] and doc["collective"] == collective
    assert all(r["mpi_shared0_us"] > 0 for r in doc["rows"])


@needs_shmtree
@pytest.mark.timeout(120)
def test_compare_shared_prints_mpi_on_shared_memory_beside_the_others(tmp_path, capsys):
    """--shared with --methods: shmtree's and MPI's shared-memory columns beside the plain ones."""
    python = _mpi_python()
    if python is None:
        pytest.skip("mpi4py is not installed (set SHMTREE_TEST_MPI_PYTHON to a python with it)")
    doc = _json(tmp_path, ["compare", "--methods", "shmtree,copy,mpi", "--shared",
                           "--mpi-python", python] + TINY)
    header = capsys.readouterr().out.split("(x = that method's time / shmtree's)\n")[1]
    header = header.splitlines()[0]
    assert list(doc["methods"]) == ["shmtree", "shared", "mpi0", "mpi_shared0", "copy"]
    labels = [doc["methods"][k]["label"] for k in ("shmtree", "shared", "mpi0", "mpi_shared0")]
    at = [header.index(f"{label} (us)") for label in labels]
    assert at == sorted(at), header
    for r in doc["rows"]:
        assert r["mpi_shared0_us"] > 0 and r["mpi_shared0_vs_shmtree"] > 0 and r["mpi0_us"] > 0


@needs_shmtree
@timeout
@pytest.mark.parametrize("collective, nprocs", [
    pytest.param(c, n, marks=needs_calls, id=f"{c}-{n}")
    for c, n in [(c, 2) for c in NEW] + [("alltoall", 3), ("alltoallv", 3), ("scatter", 3)]])
def test_compare_new_collectives_on_shared_arrays(tmp_path, collective, nprocs):
    """alltoall(v), gather, scatter, scan, exscan of shared inputs (comm.empty) into private
    outputs, checked (which block went where) then timed, beside the private call."""
    doc = _json(tmp_path, ["compare", "--collective", collective, "--methods", "shmtree",
                           "--shared", "--sizes", "8,4K", "-n", str(nprocs), "--iters", "2",
                           "--dtype", "int32"])
    assert list(doc["methods"])[:2] == ["shmtree", "shared"]
    assert all(m["status"] == "ok" for m in doc["methods"].values()), doc["methods"]
    for r in doc["rows"]:
        assert r["shmtree_us"] > 0 and r["shared_us"] > 0 and r["shared_vs_shmtree"] > 0


@needs_shmtree
@timeout
def test_compare_shmtree_without_the_call_says_na(monkeypatch, capsys):
    """A shmtree whose Communicator lacks the collective's method (older than the call): its
    columns say n/a and why, the copy is still measured, the exit status is 1."""
    import shmtree
    monkeypatch.setattr(shmtree, "Communicator", type("Communicator", (), {}))
    assert main(["compare", "--collective", "scan", "--methods", "shmtree,copy", "--shared"]
                + TINY) == 1
    out = capsys.readouterr().out
    assert out.count("n/a (no comm.scan in shmtree") == 2 * 2 + 2, out   # cells + lines below
    assert "copy (us)" in out
    from shmtree.bench import scaling
    assert scaling.default_collectives() == []


@timeout
def test_persistent_parses():
    args = parse(["persistent"])
    assert args.command == "persistent" and args.nprocs is None and args.sizes == [8]
    assert args.repeats == 5 and args.dtype == np.float32 and args.op == "sum"
    args = parse(["persistent", "-n", "2,1", "--sizes", "8,1K", "--repeats", "2", "--tree",
                  "chain"])
    assert args.nprocs == [1, 2] and args.sizes == [8, 1024] and args.tree == "chain"
    for bad in (["persistent", "--repeats", "0"], ["persistent", "-n", "0"],
                ["persistent", "--fresh"]):
        with pytest.raises(SystemExit) as stop:
            parse(bad)
        assert stop.value.code == 2


@needs_shmtree
@needs_calls
@timeout
def test_persistent_beside_plain(tmp_path, capsys):
    """P = 1 and 2, two rounds: both methods timed in every round, the ratio is theirs."""
    doc = _json(tmp_path, ["persistent", "-n", "1,2", "--iters", "3", "--repeats", "2"])
    out = capsys.readouterr().out
    assert out.startswith("# shmtree ") and "persistent allreduce: P = 1, 2, float32 sum" in out
    assert "plain (us)" in out and "p() (us)" in out and "p()/plain" in out
    assert doc["command"] == "persistent" and doc["options"]["repeats"] == 2
    assert [(r["nprocs"], r["size"]) for r in doc["rows"]] == [(1, 8), (2, 8)]
    for r in doc["rows"]:
        assert len(r["plain_rounds_us"]) == len(r["persistent_rounds_us"]) == 2
        assert r["plain_us"] > 0 and r["persistent_us"] > 0
        assert r["ratio"] == pytest.approx(r["persistent_us"] / r["plain_us"])
        assert r["ratio_min"] <= r["ratio_max"]


@needs_shmtree
@timeout
def test_persistent_without_allreduce_init(monkeypatch, capsys):
    import shmtree
    monkeypatch.setattr(shmtree, "Communicator", type("Communicator", (), {}))
    assert main(["persistent", "-n", "1", "--iters", "3", "--repeats", "1"]) == 1
    assert "has no comm.allreduce_init" in capsys.readouterr().err


@timeout
def test_repro_parses():
    args = parse(["repro"])
    assert args.command == "repro" and args.nprocs is None and args.sizes == [8, 32 << 10, 1 << 20]
    assert args.repeats == 3 and args.dtype == np.float64 and args.op == "sum"
    args = parse(["repro", "-n", "3,2", "--sizes", "8,1K", "--repeats", "2", "--tree", "ring"])
    assert args.nprocs == [2, 3] and args.sizes == [8, 1024] and args.tree == "ring"
    for bad in (["repro", "--repeats", "0"], ["repro", "-n", "0"], ["repro", "--fresh"]):
        with pytest.raises(SystemExit) as stop:
            parse(bad)
        assert stop.value.code == 2


@needs_shmtree
@timeout
def test_repro_beside_plain(tmp_path, capsys):
    """P = 1 and 2, two rounds: every method timed, the ratios are theirs; the targets said."""
    import shmtree
    if not hasattr(shmtree, "Accumulator"):
        pytest.skip("this shmtree has no Accumulator")
    doc = _json(tmp_path, ["repro", "-n", "1,2", "--sizes", "8,40K", "--iters", "3",
                           "--repeats", "2"])
    out = capsys.readouterr().out
    assert out.startswith("# shmtree ") and "reproducible sums: P = 1, 2, float64 sum" in out
    assert "deterministic (us)" in out and "Accumulator (us)" in out and "<= 1.15x" in out
    assert doc["command"] == "repro"
    assert [(r["nprocs"], r["size"]) for r in doc["rows"]] == [(1, 8), (1, 40960), (2, 8),
                                                                (2, 40960)]
    for r in doc["rows"]:
        for m in ("deterministic", "accumulator", "reproducible"):
            assert r[f"{m}_us"] > 0 and r[f"{m}_ratio"] == pytest.approx(
                r[f"{m}_us"] / r["plain_us"])
        assert r["accumulator_words"] >= 1


@needs_shmtree
@timeout
def test_repro_without_an_accumulator(monkeypatch, capsys):
    import shmtree
    monkeypatch.delattr(shmtree, "Accumulator")
    assert main(["repro", "-n", "1", "--iters", "3", "--repeats", "1"]) == 1
    assert "has no Accumulator" in capsys.readouterr().err


@timeout
def test_numa_matrix_with_two_nodes(monkeypatch):
    """A two-node matrix (here: each CPU as its own "node"), so multi-node code paths run."""
    cpus = sorted(os.sched_getaffinity(0))
    fake = {0: cpus[:1], 1: cpus[1:] or cpus[:1]}
    monkeypatch.setattr(numa, "numa_nodes", lambda: fake)
    mat = numa.matrix(1 << 20, Plan(iters=2))
    assert mat["nodes"] == [0, 1] and all(len(r) == 2 for r in mat["read_gbs"])
    assert numa.one_node_note(mat) is None


@needs_shmtree
@pytest.mark.timeout(120)
def test_overlap_reports_posting_blocking_and_overlap(tmp_path, capsys):
    out = tmp_path / "o.json"
    assert main(["overlap", "--size", "256K", "--repeats", "2", "--posts", "30",
                 "--compute", "sleep,numpy", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "iallreduce, posting only" in text and "blocking, after" in text
    doc = json.loads(out.read_text())
    got = doc["results"]
    assert set(got["overlap"]) == {"sleep", "numpy"}
    for key in ("post_us", "blocking_before_us", "blocking_after_us", "T_us"):
        assert got[key] > 0
    for row in got["overlap"].values():
        assert row["O_us"] > 0 and row["C_us"] > 0
        assert row["ratio"] == pytest.approx(row["O_us"] / max(got["T_us"], row["C_us"]))


@timeout
def test_overlap_refuses_an_unknown_computation(capsys):
    assert main(["overlap", "--compute", "sleep,gpu"]) == 2
    assert "--compute takes sleep,numpy,python" in capsys.readouterr().err


@needs_shmtree
@pytest.mark.timeout(120)
def test_compare_shared_column(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert main(["compare", "--shared", "--methods", "shmtree,shared,copy", "--sizes", "8,256K",
                 "-n", "2", "--iters", "3", "--json", str(out)]) == 0
    assert "shmtree shared (us)" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert all(r["shared_us"] > 0 and r["shmtree_us"] > 0 for r in rows)


@timeout
def test_multinode_measures_every_part(tmp_path, capsys):
    """shmtree-bench multinode under mpiexec: 3 processes in simulated nodes of 2 (2 + 1),
    every column measured."""
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("needs mpi4py and an MPI")
    doc = _json(tmp_path, ["multinode", "-n", "3", "--node-size", "2", "--sizes", "8,64K",
                           "--repeats", "2"])
    out = capsys.readouterr().out
    assert doc["nodes"] == 2 and doc["nprocs"] == 3 and doc["node_size"] == 2
    assert [r["bytes"] for r in doc["rows"]] == [8, 64 << 10]
    for r in doc["rows"]:
        assert all(r[k] > 0 for k in ("hier_us", "mpi_us", "intra_us", "inter_us")), r
    assert "across 2 simulated nodes" in out and "hier/max(intra,inter)" in out


# --- issue 21, item 18: mistakes on the command line are refused before anything is measured --

def _never_measure(monkeypatch):
    from shmtree.bench import compare, multinode, overlap, sweep

    def refuse(*args, **kwargs):
        raise AssertionError("the bench measured although its arguments were wrong")
    for module, name in ((sweep, "run_sweep"), (compare, "run_all"), (numa, "matrix"),
                         (overlap, "run_overlap"), (multinode, "run")):
        monkeypatch.setattr(module, name, refuse)


@timeout
@pytest.mark.parametrize("argv,option", [
    (argv, option) for argv in (["allreduce"], ["compare"], ["numa", "--quick"])
    for option in ("--json", "--csv", "--plot")]
    + [(["topology"], "--json"), (["overlap"], "--json"), (["multinode"], "--json")])
def test_output_into_a_missing_directory_is_refused_before_measuring(tmp_path, capsys,
                                                                     monkeypatch, argv, option):
    """--json / --csv into a missing directory gave a traceback after the whole run."""
    _never_measure(monkeypatch)
    if option == "--plot":
        monkeypatch.setattr("shmtree.bench.plot.require", lambda: None)
    target = tmp_path / "missing" / "out.file"
    with pytest.raises(SystemExit) as stop:
        main(argv + ["--sizes" if argv[0] not in ("topology", "overlap") else "-n",
                     "8" if argv[0] not in ("topology", "overlap") else "2",
                     option, str(target)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: cannot write" in err and "does not exist" in err, err
    assert "Traceback" not in err and not (tmp_path / "missing").exists()


@timeout
def test_output_onto_a_directory_is_refused(tmp_path, capsys, monkeypatch):
    _never_measure(monkeypatch)
    with pytest.raises(SystemExit) as stop:
        main(["allreduce", "--sizes", "8", "--csv", str(tmp_path)])
    assert stop.value.code == 2
    assert "is a directory, not a file" in capsys.readouterr().err


@timeout
@pytest.mark.parametrize("option,value", [("--time", "-1"), ("--time", "0"), ("--time", "nan"),
                                          ("--time", "inf"), ("--timeout", "-1"),
                                          ("--timeout", "0")])
def test_time_and_timeout_must_be_positive(capsys, option, value):
    for command in ("allreduce", "compare", "numa"):
        with pytest.raises(SystemExit) as stop:
            parse([command, f"{option}={value}"])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {option}: must be a number of seconds > 0, got {value}" in err, err
    assert parse(["--time", "0.5", "--timeout", "30"]).time == 0.5


@timeout
def test_sizes_are_rounded_to_whole_items_with_a_note(monkeypatch, capsys):
    """--sizes 7 with float32 silently measured 4 B."""
    from shmtree.bench import sweep
    seen = []

    def fake(sizes, nprocs, plan, options, with_copy, progress):
        seen.append(list(sizes))
        one = {"median_s": 1e-6, "min_s": 1e-6, "mean_s": 1e-6, "iters": 1}
        return {s: {"allreduce": one, "copy": one} for s in sizes}
    monkeypatch.setattr(sweep, "run_sweep", fake)
    assert main(["allreduce", "--sizes", "4,7,4K", "-n", "2", "--iters", "1"]) == 0
    assert seen == [[4, 4096]]                         # what is measured: 7 B is one item, 4 B
    out, err = capsys.readouterr()
    note = "--sizes rounded to whole float32 items (4 B each): 7 B -> 4 B"
    assert f"shmtree-bench: note: {note}" in err
    assert f"# {note}" in out.splitlines()[2]
    assert main(["allreduce", "--sizes", "8,4K", "-n", "2", "--iters", "1"]) == 0
    assert "rounded" not in "".join(capsys.readouterr())      # nothing to say: no note


@timeout
def test_sizes_of_blocks_are_rounded_with_a_note(tmp_path, capsys):
    doc = _json(tmp_path, ["compare", "--collective", "allgather", "--methods", "copy",
                           "--sizes", "8,4K", "-n", "3", "--iters", "2"])
    assert [r["size"] for r in doc["rows"]] == [12, 4092]
    assert doc["options"]["sizes"] == [12, 4092]
    out, err = capsys.readouterr()
    assert ("--sizes rounded to whole float32 items (4 B each) in 3 equal blocks: 8 B -> 12 B, "
            "4 KiB -> 4092 B") in err


@timeout
def test_multinode_sizes_are_rounded_to_whole_float32_items(monkeypatch, capsys):
    from shmtree.bench import multinode
    seen = []

    def fake(nprocs, node_size, sizes, repeats, segment):
        seen.append(list(sizes))
        return {"nodes": 2, "nprocs": nprocs, "node_size": node_size, "library": "fake",
                "rows": [{"bytes": s, "hier_us": 1.0, "mpi_us": 1.0, "intra_us": 1.0,
                          "inter_us": 1.0} for s in sizes]}
    monkeypatch.setattr(multinode, "run", fake)
    assert main(["multinode", "-n", "4", "--sizes", "6,64K"]) == 0
    assert seen == [[4, 65536]]
    out, err = capsys.readouterr()
    assert "--sizes rounded to whole float32 items (4 B each): 6 B -> 4 B" in err
    assert "# --sizes rounded" in out


@needs_shmtree
@pytest.mark.timeout(180)
def test_torch_beside_gloo(tmp_path, capsys):
    """shmtree-bench torch at tiny sizes: a row per op and size with both backends' times and
    their ratio, the bfloat16 line, FSDP and DDP steps with equal results (times never
    asserted)."""
    pytest.importorskip("torch.distributed")
    from shmtree.bench.torchdist import OPS
    js = tmp_path / "t.json"
    assert main(["torch", "--sizes", "8,4K", "--reps", "2", "--rounds", "2", "--steps", "1",
                 "--bf16-size", "4K", "--json", str(js)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# shmtree-bench torch: torch ") and "2 processes" in lines[0]
    assert lines[1].split() == ["op", "size", "gloo", "(us)", "shmtree", "(us)", "shmtree/gloo"]
    rows = [line.split() for line in lines[2:2 + 2 * len(OPS)]]
    assert [(r[0], " ".join(r[1:3])) for r in rows] == [(op, s) for op in OPS
                                                        for s in ("8 B", "4 KiB")]
    for r in rows:
        g, m, ratio = map(float, r[3:])
        assert g > 0 and m > 0 and abs(ratio - m / g) < 0.01 + 0.01 * ratio
    rest = lines[2 + 2 * len(OPS):]
    assert rest[0].startswith("bfloat16/float32 all_reduce element rate (1024 elements, 4 KiB")
    assert rest[1].startswith("FSDP step (4 x Linear(512), batch 8)")
    assert rest[2].startswith("DDP step (") and rest[3].startswith("  its allreduce ")
    for line in rest[1:4]:
        g, m, ratio = re.search(r"ms: gloo +(\S+), shmtree +(\S+) \(gloo/shmtree (\S+)\)$",
                                line).groups()
        assert float(g) > 0 and float(m) > 0 and float(ratio) > 0
    assert rest[4].startswith("FSDP losses, shmtree vs gloo: max |difference| ")
    assert rest[5].startswith("DDP final parameters, shmtree vs gloo: max |difference| ")
    assert float(rest[4].split()[-1]) <= 1e-6 and float(rest[5].split()[-1]) <= 1e-5
    assert len(rest) == 6
    doc = json.loads(js.read_text())
    assert doc["nprocs"] == 2 and len(doc["ops"]) == 2 * len(OPS)
    assert set(doc["ops"][0]) == {"op", "bytes", "gloo", "shmtree"}
    assert set(doc["bf16"]) == {"gloo", "shmtree"} and set(doc["fsdp"]) == {"gloo", "shmtree"}


@timeout
def test_idle_reports_cpu_and_wakeups(capsys):
    assert main(["idle", "--wait", "0.3", "--wakes", "5", "--rounds", "1", "--late", "0.001"]) == 0
    out = capsys.readouterr().out
    assert "cpu while waiting" in out and "OS floor" in out
    row = [line for line in out.splitlines() if line.strip().startswith("1 ")]
    assert len(row) == 1, out
    cells = row[0].split()
    assert cells[1].endswith("%") and 0 <= float(cells[1][:-1]) < 100, out
    assert all(float(c) > 0 for c in cells[2:5]), out
