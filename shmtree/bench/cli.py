"""The ``shmtree-bench`` command line: argument parsing and the four commands.

    shmtree-bench                      the default sweep (= shmtree-bench allreduce)
    shmtree-bench allreduce [...]      sizes x shmtree allreduce, with the memory-copy limit
    shmtree-bench compare [...]        shmtree vs numpy+shared_memory, Pipe, MPI, gloo, copy
    shmtree-bench compare --collective broadcast|reduce|allgather|reduce_scatter [...]
                                       that collective: shmtree vs MPI and the copy
    shmtree-bench numa [...]           node x node copy bandwidth; shmtree's placement knobs
    shmtree-bench topology [...]       the plan a shmtree.Group with these options runs
    shmtree-bench overlap [...]        nonblocking calls: posting cost, overlap with computation
    shmtree-bench --version            "shmtree-bench <shmtree's version>"

Arguments that do not start with a command name go to ``allreduce``, so ``shmtree-bench
--sizes 8,1M`` works.  This module only parses, dispatches, prints and writes; measuring is done
by ``sweep``, ``compare``, ``numa``; output by ``report`` and ``plot``.

Exit status: 0 done, 1 the benchmark failed (message on stderr), 2 bad arguments, 130
interrupted (Ctrl-C or SIGTERM), 141 (= 128 + SIGPIPE, what a shell reports for a tool killed by
a broken pipe) when whoever reads the output stopped reading (``shmtree-bench ... | head -1``):
the rest of the output is dropped without a traceback.
"""
import argparse
import functools
import os
import signal
import sys
import threading

from . import compare, machine, multinode, numa, overlap, plot, report, sweep
from .harness import BenchError
from .measure import COLLECTIVES, MOVES_ONLY, TARGET_S, Plan, whole_bytes
from .units import format_size, parse_dtype, parse_op, parse_size, parse_sizes

COMMANDS = ("allreduce", "compare", "numa", "topology", "overlap", "multinode")
DEFAULT_SIZES = {"allreduce": "8:64M:x8", "compare": "8,32K,2M,16M,64M", "numa": "32K,2M,64M"}
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE      # 141, as a shell reports a tool killed by SIGPIPE
QUICK_TARGET_S = 0.02                       # numa --quick: seconds of timed calls per cell
QUICK_MATRIX_SIZE = 1 << 20                 # numa --quick: bytes per matrix cell


def _arg(convert):
    """An argparse type from a parser that raises ValueError."""
    def parse(text):
        try:
            return convert(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parse.__name__ = convert.__name__
    return parse


def _tree(text):
    return int(text) if text.isdigit() else text


def _positive(text):
    value = int(text)
    if value < 1:
        raise ValueError(f"must be at least 1, got {value}")
    return value


def _nonnegative_float(text):
    value = float(text)
    if not value >= 0:
        raise ValueError(f"must be a number >= 0, got {text}")
    return value


def _positive_seconds(text):
    value = float(text)
    if not 0 < value < float("inf"):
        raise ValueError(f"must be a number of seconds > 0, got {text}")
    return value


def _group_arguments(p):
    g = p.add_argument_group("shmtree group options (default: shmtree's own)")
    g.add_argument("--topology", help='spec such as "2x4", or a topology JSON file')
    g.add_argument("--tree", type=_tree, help="auto, topology, chain, binary, flat, ring, or k")
    g.add_argument("--chunk-bytes", type=_arg(parse_size), help="pipeline chunk size, e.g. 64K")
    g.add_argument("--slots", type=_arg(_positive), help="ring slots per edge")
    g.add_argument("--placement", choices=("compact", "spread"))
    g.add_argument("--numa", choices=("consumer", "producer", "interleave"),
                   help="where ring pages live")
    g.add_argument("--pin", action=argparse.BooleanOptionalAction, default=None,
                   help="pin each rank to one core")
    g.add_argument("--small-bytes", type=_arg(parse_size),
                   help="largest message carried inline in the latency round, e.g. 4K")
    g.add_argument("--nt-bytes", type=_arg(parse_size),
                   help="streaming stores from this message size (0: never)")
    g.add_argument("--spin-us", type=_arg(_nonnegative_float),
                   help="microseconds to busy-wait before yielding")


def _measure_arguments(p, command, nprocs_help):
    p.add_argument("--sizes", type=_arg(parse_sizes), default=DEFAULT_SIZES[command],
                   help='bytes: "8,1K,64M" or a range "8:64M:x8" '
                        f"(default {DEFAULT_SIZES[command]})")
    p.add_argument("-n", "--nprocs", type=_arg(_positive), help=nprocs_help)
    p.add_argument("--dtype", type=_arg(parse_dtype), default="float32",
                   help="numpy dtype of the arrays (default float32)")
    p.add_argument("--op", type=_arg(parse_op), default="sum", help="sum, prod, min or max")
    p.add_argument("--iters", type=_arg(_positive),
                   help=f"timed calls per size (default: adaptive, about {TARGET_S} s)")
    p.add_argument("--time", type=_arg(_positive_seconds),
                   help=f"adaptive: seconds of timed calls per size (default {TARGET_S})")
    p.add_argument("--fresh", action="store_true",
                   help="cache-cold buffers: rotate through more memory than the LLC")
    p.add_argument("--timeout", type=_arg(_positive_seconds), default=60.0,
                   help="seconds one shmtree allreduce may take before it is an error (60)")
    _output_arguments(p)


def _output_arguments(p):
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--csv", metavar="FILE", help="write the rows as CSV")
    p.add_argument("--plot", metavar="FILE.png", help="write a plot (needs matplotlib)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress on stderr (default: when stderr is a terminal)")


def build_parser():
    parser = argparse.ArgumentParser(
        prog="shmtree-bench",
        description="Benchmarks for shmtree's allreduce. Without a command, or with options "
                    "only, runs the allreduce sweep (shmtree-bench --sizes 8,1M = "
                    "shmtree-bench allreduce --sizes 8,1M).")
    parser.add_argument("--version", action="version",
                        version=f"shmtree-bench {machine.shmtree_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("allreduce", help="allreduce sweep with the memory-copy limit")
    _measure_arguments(p, "allreduce", "processes (default: usable cores)")
    _group_arguments(p)
    p = sub.add_parser("compare", help="shmtree vs numpy-shm, pipe, MPI, gloo and copy")
    _measure_arguments(p, "compare", "processes (default: 2)")
    _group_arguments(p)
    p.add_argument("--mpi-python", action="append", metavar="PATH",
                   help="an interpreter with mpi4py (repeatable: one MPI column each; "
                        "default: this interpreter)")
    p.add_argument("--methods",
                   help=f"comma-separated subset of {','.join(compare.ALL_METHODS)} (default: "
                        "all of them for allreduce; shmtree,copy,mpi for the other "
                        "collectives, which numpy-shm, pipe and gloo do not measure)")
    p.add_argument("--shared", action="store_true",
                   help="also measure the call on shared arrays (comm.empty): the single-copy "
                        "path (column 'shmtree shared'), and MPI on MPI.Win.Allocate_shared "
                        "memory (column '<MPI> shared'); with --methods, beside shmtree and mpi")
    p.add_argument("--collective", choices=COLLECTIVES, default="allreduce",
                   help="the collective to measure (default allreduce), root 0; a size is the "
                        "whole buffer, as in nccl-tests: allgather's result, reduce_scatter's "
                        "input, each of P blocks")
    p = sub.add_parser("numa", help="NUMA copy-bandwidth matrix and shmtree's placement knobs")
    _measure_arguments(p, "numa", "processes for the allreduce part (default: usable cores)")
    _group_arguments(p)
    p.add_argument("--matrix-size", type=_arg(_positive_size),
                   help=f"bytes per matrix cell (default 64M; {format_size(QUICK_MATRIX_SIZE)} "
                        "with --quick)")
    p.add_argument("--quick", "--short", action="store_true",
                   help="a smoke test in a few seconds, not a result: only the first size of "
                        f"--sizes, {format_size(QUICK_MATRIX_SIZE)} matrix cells and about "
                        f"{QUICK_TARGET_S} s of timed calls per cell and knob (unless "
                        "--matrix-size, --time or --iters say otherwise)")
    p = sub.add_parser(
        "topology", help="the plan a shmtree.Group with these options runs (trees, schedule)",
        description="Prints the topology, then exactly what shmtree.Group(n, **options).plan."
                    "describe() prints for the same options: the latency tree, the bandwidth "
                    "tree or ring schedule, chunk size, slots, inline limit, pinning.")
    p.add_argument("-n", "--nprocs", type=_arg(_positive),
                   help="ranks (default: the cores of --topology, else the usable cores)")
    p.add_argument("--json", metavar="FILE",
                   help="write the plan as JSON (trees as parent lists, schedule, chunk, slots, "
                        "small_bytes, digest)")
    _group_arguments(p)
    p = sub.add_parser(
        "overlap", help="nonblocking calls: posting cost, blocking cost, overlap",
        description="Posting cost of an 8-byte iallreduce, the blocking 8-byte allreduce "
                    "before and after nonblocking use, and how much of an allreduce of --size "
                    "bytes hides behind a computation of the same length (sleep, numpy that "
                    "releases the GIL, pure Python).")
    p.add_argument("-n", "--nprocs", type=_arg(_positive), default=2,
                   help="processes (default: 2)")
    p.add_argument("--size", type=_arg(_positive_size), default=16 << 20,
                   help="bytes of the overlapped allreduce (default 16M)")
    p.add_argument("--repeats", type=_arg(_positive), default=15,
                   help="timed repetitions of each overlap measurement (default 15)")
    p.add_argument("--posts", type=_arg(_positive), default=2000,
                   help="timed 8-byte calls for the posting and blocking figures (default 2000)")
    p.add_argument("--compute", default=",".join(overlap.COMPUTES),
                   help=f"comma-separated subset of {','.join(overlap.COMPUTES)}")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    _group_arguments(p)
    p = sub.add_parser(
        "multinode", help="allreduce across simulated nodes (from_mpi) beside MPI",
        description="Launches mpiexec (beside this interpreter) with -n processes grouped in "
                    "simulated nodes of --node-size consecutive ranks; per size, the median "
                    "float32 sum allreduce of shmtree.from_mpi (hier), COMM_WORLD.Allreduce "
                    "(mpi), the nodes' own allreduce alone (intra) and the leaders' inter-node "
                    "step alone (inter).  Needs mpi4py and an MPI (pip install "
                    "\"shmtree[mpi]\").")
    p.add_argument("-n", "--nprocs", type=_arg(_positive), default=4,
                   help="processes (default: 4)")
    p.add_argument("--node-size", type=_arg(_positive), default=2,
                   help="processes per simulated node (default: 2)")
    p.add_argument("--sizes", type=_arg(parse_sizes), default=parse_sizes(multinode.DEFAULT_SIZES),
                   help=f"message sizes (default {multinode.DEFAULT_SIZES})")
    p.add_argument("--repeats", type=_arg(_positive), default=5,
                   help="timed calls per size at 8 MiB and above (more below; default 5)")
    p.add_argument("--segment", type=_arg(_positive_size),
                   help="bytes per pipelined segment across the node boundary (default: "
                        "shmtree.nodes.SEGMENT_BYTES)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    return parser


def parse(argv):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help", "--version")):
        argv.insert(0, "allreduce")
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    for option in ("json", "csv", "plot"):
        problem = _unwritable(getattr(args, option, None))
        if problem:
            parser.error(f"argument --{option}: {problem} (checked before measuring, so that "
                         "no results are lost)")
    if getattr(args, "plot", None):
        plot.require()
    return args


def _unwritable(path):
    """Why the results file `path` could not be written at the end of the run ('' if it can):
    its directory is missing or not writable, or it is a directory."""
    if not path:
        return ""
    if os.path.isdir(path):
        return f"{path!r} is a directory, not a file"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"cannot write {path!r}: the directory {folder!r} does not exist"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"cannot write {path!r}: the directory {folder!r} is not writable"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return f"cannot write {path!r}: the file is not writable"
    return ""


def _whole_sizes(args, nprocs, collective="allreduce"):
    """Round --sizes to what is measured: whole items of --dtype (and, for allgather and
    reduce_scatter, P equal blocks of at least one item), before measuring.  A size that
    changes is said on stderr at once and returned as a '#' line for the output; args.sizes
    becomes the sizes measured (distinct, sorted)."""
    dtype = args.dtype
    whole = {s: whole_bytes(collective, s, dtype, nprocs) for s in args.sizes}
    changed = {s: w for s, w in whole.items() if s != w}
    args.sizes = sorted(set(whole.values()))
    if not changed:
        return None
    unit = (f"whole {dtype} items ({dtype.itemsize} B each)"
            + (f" in {nprocs} equal blocks" if collective in ("allgather", "reduce_scatter")
               else ""))
    note = (f"--sizes rounded to {unit}: "
            + ", ".join(f"{format_size(s)} -> {format_size(w)}" for s, w in changed.items()))
    print(f"shmtree-bench: note: {note}", file=sys.stderr)
    return f"# {note}"


def main(argv=None):
    """Entry point of ``shmtree-bench`` and ``python -m shmtree.bench``; returns the exit code.

    A reader that stops reading (``| head``) ends the command quietly with EXIT_BROKEN_PIPE, as
    the Python documentation recommends (signal module, "Note on SIGPIPE"): stdout is pointed at
    /dev/null so that the interpreter's final flush does not fail again, and no traceback is
    printed."""
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()   # buffered output meets a closed pipe here at the latest
    except BrokenPipeError:
        _stdout_to_devnull()
        return EXIT_BROKEN_PIPE


def _stdout_to_devnull():
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):   # stdout without a file descriptor (tests): nothing to flush
        pass
    finally:
        os.close(devnull)


def _main(argv):
    _terminate_like_interrupt()
    try:
        args = parse(argv)
        return {"allreduce": cmd_allreduce, "compare": cmd_compare, "numa": cmd_numa,
                "topology": cmd_topology, "overlap": cmd_overlap,
                "multinode": cmd_multinode}[args.command](args)
    except BenchError as exc:
        print(f"shmtree-bench: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("shmtree-bench: interrupted", file=sys.stderr)
        return 130


def _terminate_like_interrupt():
    """SIGTERM raises KeyboardInterrupt, so every finally (processes, /dev/shm) still runs."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, functools.partial(_on_sigterm, os.getpid()))


def _on_sigterm(main_pid, signum, frame):
    if os.getpid() == main_pid:
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a forked worker: die as if never handled
    os.kill(os.getpid(), signal.SIGTERM)


def _positive_size(text):
    value = parse_size(text)
    if value < 1:
        raise ValueError(f"a size must be at least 1 byte, got {text!r}")
    return value


def _plan(args, nprocs):
    rotation = machine.rotation_bytes(nprocs) if args.fresh else 0
    target = args.time
    if target is None:
        target = QUICK_TARGET_S if getattr(args, "quick", False) else TARGET_S
    return Plan(dtype=args.dtype, op=args.op, iters=args.iters, target_s=target,
                fresh=args.fresh, rotation_bytes=rotation, timeout=args.timeout)


def _options(args):
    return sweep.group_options(**{k: getattr(args, k, None) for k in sweep.GROUP_OPTIONS})


def _progress(args):
    return sys.stderr.isatty() if args.progress is None else args.progress


def _settings(args, nprocs, plan, **extra):
    """The command's options as recorded in JSON (everything needed to rerun it)."""
    return {"argv": args.argv, "nprocs": nprocs,
            "sizes": args.sizes, "plan": plan.as_dict(), "group_options": _options(args),
            **extra}


def _usable():
    return len(os.sched_getaffinity(0))


def _headline(what, nprocs, plan, options, with_op=True):
    knobs = ", ".join(f"{k}={v}" for k, v in options.items()) or "default group options"
    buffers = "cache-cold buffers (--fresh)" if plan.fresh else "warm buffers"
    op = f" {plan.op}" if with_op else ""
    return (f"# shmtree {machine.shmtree_version()} {what}: {nprocs} processes, {plan.dtype}"
            f"{op}, {knobs}, {buffers}\n# time = max over ranks of the median per call")


def _shmtree_failure(exc):
    """A failure inside shmtree.run (or its import) as the bench's own error."""
    return BenchError(f"shmtree: {type(exc).__name__}: {exc}")


def _write(args, doc, columns, rows):
    if args.json:
        report.write_json(args.json, doc)
    if getattr(args, "csv", None):
        report.write_csv(args.csv, columns, rows)


SWEEP_COLUMNS = {
    "size": "message bytes", "count": "elements", "time_us": "max over ranks of median time",
    "algbw_gbs": "size / time, GB/s", "busbw_gbs": "algbw * 2(P-1)/P, GB/s",
    "iters": "timed calls", "copy_us": "concurrent np.copyto of the same bytes, same processes",
    "vs_copy": "time / copy_us",
}


def cmd_allreduce(args):
    nprocs = args.nprocs or _usable()
    plan, options = _plan(args, nprocs), _options(args)
    rounded = _whole_sizes(args, nprocs)
    try:
        measured = sweep.run_sweep(args.sizes, nprocs, plan, options, True, _progress(args))
    except Exception as exc:
        raise _shmtree_failure(exc) from exc
    rows = [sweep.row(s, plan.dtype, nprocs, m["allreduce"], m["copy"])
            for s, m in measured.items()]
    print(_headline("allreduce", nprocs, plan, options))
    if rounded:
        print(rounded)
    print(report.table(
        ["size", "count", "time (us)", "algbw (GB/s)", "busbw (GB/s)", "copy (us)", "vs copy",
         "iters"],
        [[format_size(r["size"]), r["count"], report.fmt(r["time_us"]),
          report.fmt(r["algbw_gbs"]), report.fmt(r["busbw_gbs"]), report.fmt(r["copy_us"]),
          report.fmt(r["vs_copy"]) + "x", r["iters"]] for r in rows]))
    doc = report.document("allreduce", machine.describe(args.topology),
                          _settings(args, nprocs, plan), SWEEP_COLUMNS, rows)
    _write(args, doc, list(SWEEP_COLUMNS), rows)
    if args.plot:
        plot.plot_sweep(args.plot, rows, f"shmtree allreduce, P={nprocs}, {plan.dtype} {plan.op}")
    return 0


COMPARE_TITLES = {"allreduce": "allreduce", "broadcast": "broadcast (root 0)",
                  "reduce": "reduce (root 0)", "allgather": "allgather",
                  "reduce_scatter": "reduce_scatter"}
WHOLE_BUFFER = {
    "allgather": "# size = the whole gathered result (P blocks of size/P), as in nccl-tests",
    "reduce_scatter": "# size = the whole input (P blocks of size/P) each rank reduces, as in "
                      "nccl-tests",
}


def cmd_compare(args):
    nprocs = args.nprocs or 2
    plan, options = _plan(args, nprocs), _options(args)
    collective = args.collective
    given = args.methods if args.methods is not None else \
        ",".join(compare.default_methods(collective, args.shared))
    methods = [m.strip().replace("-", "_") for m in given.split(",") if m.strip()]
    methods = compare.with_shared(methods, args.shared)
    unknown = sorted(set(methods) - set(compare.ALL_METHODS))
    if unknown:
        raise BenchError(f"unknown --methods {unknown}: choose from {compare.ALL_METHODS}")
    refused = sorted(set(methods) - set(compare.methods_for(collective)))
    if refused:
        raise BenchError(f"--methods {refused} do not measure {collective}; for --collective "
                         f"{collective} choose from {compare.methods_for(collective)}")
    pythons = args.mpi_python or [sys.executable]
    rounded = _whole_sizes(args, nprocs, collective)
    columns, copy = compare.run_all(args.sizes, nprocs, plan, options, methods, pythons,
                                    _progress(args), collective)
    rows = compare.rows(args.sizes, plan.dtype, columns, copy, collective, nprocs)
    title = COMPARE_TITLES[collective]
    print(_headline(f"compare {title}", nprocs, plan, options,
                    with_op=collective not in MOVES_ONLY))
    if collective in WHOLE_BUFFER:
        print(WHOLE_BUFFER[collective])
    if rounded:
        print(rounded)
    print("# cells: time per call in us (x = that method's time / shmtree's)")
    print(compare.text_table(args.sizes, columns, copy, rows))
    for line in compare.problems(columns, copy):
        print(f"# {line}")
    doc = report.document(
        "compare", machine.describe(args.topology),
        _settings(args, nprocs, plan, methods=methods, mpi_pythons=pythons,
                  collective=collective),
        {"size": "message bytes (the whole buffer)", "count": "elements",
         "<method>_us": "time per call", "<method>_vs_shmtree": "that time / shmtree_us",
         "shmtree_vs_copy": "shmtree_us / copy_us"},
        rows, collective=collective,
        methods={c.key: c.meta() for c in compare.everything(columns, copy)})
    _write(args, doc, sorted({k for r in rows for k in r}, key=_column_order), rows)
    if args.plot:
        series = {c.label: [c.us(s) for s in args.sizes] for c in compare.everything(columns, copy)}
        op = "" if collective in MOVES_ONLY else f" {plan.op}"
        plot.plot_compare(args.plot, [r["size"] for r in rows], series,
                          f"{title}, P={nprocs}, {plan.dtype}{op}")
    shm = next((c for c in columns if c.key == "shmtree"), None)
    return 1 if shm is not None and shm.status != "ok" else 0


def _column_order(key):
    return ({"size": 0, "count": 1}.get(key, 2), key)


def cmd_numa(args):
    nprocs = args.nprocs or _usable()
    plan, options = _plan(args, nprocs), _options(args)
    if args.quick:
        args.sizes = args.sizes[:1]
    rounded = _whole_sizes(args, nprocs)
    if args.matrix_size is None:
        args.matrix_size = QUICK_MATRIX_SIZE if args.quick else 64 << 20
    cells = len([n for n, cpus in machine.numa_nodes().items() if cpus]) ** 2
    bar = report.Progress(cells + len(numa.VARIANTS), "numa", _progress(args))
    if args.quick:
        print(f"# --quick: {format_size(args.sizes[0])} only, {format_size(args.matrix_size)} "
              f"matrix cells, about {plan.target_s} s of timed calls each: a smoke test, "
              "not a result")
    mat = numa.matrix(args.matrix_size, plan, bar)
    print(numa_matrix_text(mat))
    note = numa.one_node_note(mat)
    if note:
        print(note)
    rows = numa.variant_rows(args.sizes, nprocs, plan, options, bar)
    bar.done()
    print()
    print(_headline("allreduce time (us) per knob", nprocs, plan, options))
    if rounded:
        print(rounded)
    print(numa_variants_text(rows))
    doc = report.document(
        "numa", machine.describe(args.topology),
        _settings(args, nprocs, plan, matrix_size=args.matrix_size, quick=args.quick),
        {"group": "knob", "variant": "its value", "size": "message bytes",
         "time_us": "allreduce time", "busbw_gbs": "bus bandwidth", "error": "why it failed"},
        rows, matrix=mat, note=note)
    _write(args, doc, ["group", "variant", "size", "count", "time_us", "busbw_gbs", "error"], rows)
    if args.plot:
        series = {}
        for r in rows:
            series.setdefault(_variant_label(r["group"], r["variant"]), []).append(r.get("time_us"))
        plot.plot_numa(args.plot, mat, args.sizes, series, f"NUMA report, P={nprocs}")
    return 1 if all("error" in r for r in rows) else 0


def numa_matrix_text(mat):
    names = [f"node {n}" for n in mat["nodes"]]
    parts = [f"# copy bandwidth (GB/s), {format_size(mat['size'])}, one process; row = node "
             "holding the memory (first touch), column = node of the process using it"]
    for title, key in (("read: np.copyto(local, remote)", "read_gbs"),
                       ("write: np.copyto(remote, local)", "write_gbs")):
        parts.append(f"{title}")
        parts.append(report.table(["memory \\ process"] + names,
                                  [[names[a]] + [report.fmt(v) for v in line]
                                   for a, line in enumerate(mat[key])]))
    misplaced = [(i, j, p) for a, i in enumerate(mat["nodes"]) for b, j in enumerate(mat["nodes"])
                 for p in [mat["pages_by_node"][a][b]] if p and set(p) != {str(i)}]
    parts.append("# pages landed on the intended node in every cell" if not misplaced else
                 "# misplaced pages (memory node, process node, pages by node): "
                 + "; ".join(f"{i},{j}: {p}" for i, j, p in misplaced))
    if mat["cpuless_nodes"]:
        parts.append(f"# nodes without usable CPUs, not in the matrix: {mat['cpuless_nodes']}")
    return "\n".join(parts)


def numa_variants_text(rows):
    variants = list(dict.fromkeys((r["group"], r["variant"]) for r in rows))
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    cells = {(r["group"], r["variant"], r["size"]): r for r in rows}
    lines = [[format_size(s)] + [_time_cell(cells.get((g, v, s))) for g, v in variants]
             for s in sizes]
    errors = sorted({f"{_variant_label(r['group'], r['variant'])}: {r['error']}"
                     for r in rows if "error" in r})
    headers = ["size"] + [_variant_label(g, v) for g, v in variants]
    return "\n".join([report.table(headers, lines)] + [f"# {e}" for e in errors])


def _time_cell(row):
    return "error" if row is None or "error" in row else report.fmt(row["time_us"])


def _variant_label(group, value):
    if group == "pin":
        return "pinned" if value else "unpinned"
    return f"{group}={value}"


def cmd_topology(args):
    """The plan shmtree.Group(n, **options) runs: what the group's own planner says, not a
    drawing of our own (the bench and the Group cannot disagree)."""
    options = _options(args)
    try:
        import shmtree
        from shmtree.plan import plan_group
        topo = shmtree.Topology.resolve(args.topology)
        nprocs = args.nprocs or (topo.ncpus if args.topology else _usable())
        group_plan = plan_group(nprocs, **options)
        text = group_plan.describe()
    except Exception as exc:
        raise _shmtree_failure(exc) from exc
    print(topo.describe())
    print()
    print(text)
    if args.json:
        doc = report.document("topology", machine.describe(args.topology),
                              {"argv": args.argv, "nprocs": nprocs, "group_options": options},
                              {}, [], description=topo.describe(),
                              plan=plan_as_dict(group_plan))
        report.write_json(args.json, doc)
    return 0


def plan_as_dict(plan):
    """A shmtree Plan as plain JSON data: trees as parent lists (root: -1)."""
    def tree(t):
        return {"kind": str(t.kind), "root": t.root, "depth": t.depth, "parent": list(t.parent),
                "children": [list(c) for c in t.children]}

    return {
        "size": plan.size, "tree_option": str(plan.tree_kind), "placement": plan.placement,
        "ncpus": plan.ncpus, "oversubscribed": plan.oversubscribed,
        "small_tree": tree(plan.small_tree), "small_bytes": plan.small_bytes,
        "small_slots": plan.small_slots,
        "large_tree": tree(plan.large_tree), "large_schedule": plan.large_schedule,
        "ring_order": list(plan.large_tree.ring) if plan.large_schedule == "ring" else None,
        "chunk_bytes": plan.chunk_bytes, "slots": plan.slots, "nt_bytes": plan.nt_bytes,
        "spin_us": plan.spin_ns / 1000, "pin": plan.pin, "cpu_of": list(plan.cpu_of),
        "node_of": list(plan.node_of), "numa": plan.numa, "stall_timeout": plan.stall_timeout,
        "digest": plan.digest().hex(), "describe": plan.describe(),
    }


def cmd_multinode(args):
    args.dtype = parse_dtype("float32")           # what the multinode workers reduce
    rounded = _whole_sizes(args, args.nprocs)
    got = multinode.run(args.nprocs, args.node_size, args.sizes, args.repeats, args.segment)
    print(multinode.table(got))
    if rounded:
        print(rounded)
    if args.json:
        report.write_json(args.json, report.document(
            "multinode", machine.describe(None),
            {"argv": args.argv, "nprocs": args.nprocs, "node_size": args.node_size,
             "sizes": args.sizes, "repeats": args.repeats, "segment": args.segment},
            multinode.COLUMNS, got["rows"], nodes=got["nodes"], nprocs=got["nprocs"],
            node_size=got["node_size"], library=got["library"]))
    return 0


def cmd_overlap(args):
    computes = [c for c in args.compute.split(",") if c]
    bad = [c for c in computes if c not in overlap.COMPUTES]
    if bad or not computes:
        print(f"shmtree-bench overlap: error: --compute takes {','.join(overlap.COMPUTES)}, "
              f"got {args.compute!r}", file=sys.stderr)
        return 2
    options = _options(args)
    try:
        got = overlap.run_overlap(args.nprocs, args.size, args.repeats, computes, args.posts,
                                  options)
    except Exception as exc:
        raise _shmtree_failure(exc) from exc
    knobs = ", ".join(f"{k}={v}" for k, v in options.items()) or "default group options"
    print(f"# shmtree {machine.shmtree_version()} overlap: {args.nprocs} processes, {knobs}, "
          f"{_usable()} usable cores; every figure the slowest rank's median")
    print(f"8 B iallreduce, posting only:        {got['post_us']:8.2f} us")
    print(f"8 B allreduce, blocking, before:     {got['blocking_before_us']:8.2f} us")
    print(f"8 B allreduce, blocking, after:      {got['blocking_after_us']:8.2f} us  "
          f"(x{got['blocking_after_us'] / got['blocking_before_us']:.2f})")
    T = got["T_us"]
    print(f"\n{format_size(args.size)} allreduce, blocking: T = {T:.0f} us; O = iallreduce + "
          "compute C + wait; O / max(T, C): 1 is full overlap, about 2 none")
    print(f"{'compute':>8}  {'C (us)':>9}  {'O (us)':>9}  {'O/max(T,C)':>10}  {'no overlap':>10}")
    for kind, row in got["overlap"].items():
        print(f"{kind:>8}  {row['C_us']:9.0f}  {row['O_us']:9.0f}  {row['ratio']:10.2f}  "
              f"{row['serial_ratio']:10.2f}")
    if args.json:
        report.write_json(args.json, {"command": "overlap", "argv": args.argv,
                                      "nprocs": args.nprocs, "size": args.size,
                                      "group_options": options, "results": got})
    return 0
