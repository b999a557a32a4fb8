"""The ``shmtree-bench`` command line: argument parsing and dispatch to the commands.

    shmtree-bench                      the default sweep (= shmtree-bench allreduce)
    shmtree-bench allreduce [...]      sizes x shmtree allreduce, with the memory-copy limit
    shmtree-bench compare [...]        shmtree vs numpy+shared_memory, Pipe, MPI, gloo, copy
    shmtree-bench compare --collective broadcast|reduce|allgather|reduce_scatter|alltoall|
                          alltoallv|gather|scatter|scan|exscan [...]
                                       that collective: shmtree vs MPI and the copy
    shmtree-bench persistent [...]     p() of allreduce_init beside the plain allreduce
    shmtree-bench repro [...]          deterministic=True and Accumulator allreduces beside the
                                       plain allreduce (issue 37)
    shmtree-bench numa [...]           node x node copy bandwidth; shmtree's placement knobs
    shmtree-bench topology [...]       the plan a shmtree.Group with these options runs
    shmtree-bench overlap [...]        nonblocking calls: posting cost, overlap with computation
    shmtree-bench multinode [...]      allreduce across simulated nodes (from_mpi) beside MPI
    shmtree-bench scaling [...]        P x collective x size x private/shared arrays, vs MPI
    shmtree-bench torch [...]          torch.distributed: backend shmtree beside gloo (every op,
                                       FSDP and DDP steps, bfloat16)
    shmtree-bench idle [...]           a waiting rank's CPU use and wake-up time
    shmtree-bench survive [...]        a lost rank: detection, revoke, agree, shrink, respawn
    shmtree-bench --version            "shmtree-bench <shmtree's version>"

Arguments that do not start with a command name go to ``allreduce``, so ``shmtree-bench
--sizes 8,1M`` works.  This module only parses and dispatches: the commands' bodies are in
``commands`` (``cmd_<name>``) and ``scaling``; measuring is done by ``sweep``, ``compare``,
``numa``; output by ``report`` and ``plot``.

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

from . import (commands, compare, idle, machine, multinode, overlap, p2p, persistent, plot,
               repro, scaling, split, survive, torchdist)
from .commands import QUICK_MATRIX_SIZE, QUICK_TARGET_S
from .harness import BenchError
from .measure import COLLECTIVES, TARGET_S
from .units import format_size, parse_dtype, parse_op, parse_size, parse_sizes

COMMANDS = ("allreduce", "compare", "numa", "topology", "overlap", "multinode", "scaling",
            "p2p", "persistent", "split", "torch", "idle", "repro", "survive")
DEFAULT_SIZES = {"allreduce": "8:64M:x8", "compare": "8,32K,2M,16M,64M", "numa": "32K,2M,64M",
                 "scaling": scaling.DEFAULT_SIZES}
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE      # 141, as a shell reports a tool killed by SIGPIPE


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


def _measure_arguments(p, command, nprocs_help, nprocs_type=_positive):
    p.add_argument("--sizes", type=_arg(parse_sizes), default=DEFAULT_SIZES[command],
                   help='bytes: "8,1K,64M" or a range "8:64M:x8" '
                        f"(default {DEFAULT_SIZES[command]})")
    p.add_argument("-n", "--nprocs", type=_arg(nprocs_type), help=nprocs_help)
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
    _output_arguments(p, with_plot=command != "scaling")


def _output_arguments(p, with_plot=True):
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--csv", metavar="FILE", help="write the rows as CSV")
    if with_plot:
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
                        "whole buffer, as in nccl-tests: allgather's and gather's result, "
                        "reduce_scatter's, scatter's and alltoall's input, each of P blocks; "
                        "alltoallv: alltoall with counts= (MPI_Alltoallv) of P equal blocks")
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
                        "shmtree.internode.nodes.SEGMENT_BYTES)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    _scaling_parser(sub)
    p2p.add_parser(sub, _arg, _positive)             # point-to-point (issue 24)
    split.add_parser(sub, _arg, _positive)           # sub-communicators (issue 24)
    _persistent_parser(sub)
    torchdist.add_parser(sub, _arg, _positive)       # torch.distributed beside gloo (issue 25)
    idle.add_parser(sub, _arg, _positive)            # a waiting rank's CPU and wake-up
    repro.add_parser(sub, _arg, _positive, parse_sizes, parse_dtype, scaling.parse_nprocs,
                     _positive_seconds, _output_arguments, _group_arguments)     # (issue 37)
    survive.add_parser(sub, _arg, _positive)         # a lost rank (issue 38)
    return parser


def _persistent_parser(sub):
    p = sub.add_parser(
        "persistent", help="p() of comm.allreduce_init beside the plain comm.allreduce",
        description="For every process count and size: the plain comm.allreduce(x, op, out=x) "
                    "and p() of p = comm.allreduce_init(x, op, out=x), measured alternately in "
                    "the same workers for --repeats rounds; the median of the rounds of each, "
                    "their ratio, and the spread of the rounds' ratios.")
    p.add_argument("--sizes", type=_arg(parse_sizes), default=persistent.DEFAULT_SIZES,
                   help=f"bytes (default {persistent.DEFAULT_SIZES})")
    p.add_argument("-n", "--nprocs", type=_arg(scaling.parse_nprocs),
                   help="comma-separated process counts (default "
                        f"{','.join(map(str, persistent.DEFAULT_NPROCS))})")
    p.add_argument("--dtype", type=_arg(parse_dtype), default="float32",
                   help="numpy dtype of the arrays (default float32)")
    p.add_argument("--op", type=_arg(parse_op), default="sum", help="sum, prod, min or max")
    p.add_argument("--iters", type=_arg(_positive),
                   help=f"timed calls per round (default: adaptive, about {TARGET_S} s)")
    p.add_argument("--time", type=_arg(_positive_seconds),
                   help=f"adaptive: seconds of timed calls per round (default {TARGET_S})")
    p.add_argument("--repeats", type=_arg(_positive), default=persistent.DEFAULT_REPEATS,
                   help="rounds of (plain, persistent) measurements (default "
                        f"{persistent.DEFAULT_REPEATS})")
    p.set_defaults(fresh=False, timeout=60.0)
    _output_arguments(p, with_plot=False)
    _group_arguments(p)


def _scaling_parser(sub):
    p = sub.add_parser(
        "scaling", help="P x collective x size x private/shared arrays, shmtree beside MPI",
        description="For every process count, collective and size: shmtree's time on private "
                    "and on shared arrays (comm.empty) beside MPI's (its own function; the "
                    "single copy on MPI_Win_allocate_shared memory), and MPI/shmtree; the "
                    "measurements of 'compare --collective C --shared'.  Without MPI the "
                    "header says why and shmtree's numbers are still printed.")
    _measure_arguments(p, "scaling",
                       "comma-separated process counts (default "
                       f"{','.join(map(str, scaling.DEFAULT_NPROCS))}, those up to "
                       "--max-procs; given here, all of them, oversubscribed if need be)",
                       nprocs_type=scaling.parse_nprocs)
    _group_arguments(p)
    p.add_argument("--max-procs", type=_arg(_positive),
                   help="measure no P above this (default: the usable cores, at least 2, "
                        "unless --nprocs is given)")
    p.add_argument("--collectives", type=_arg(scaling.parse_collectives),
                   help=f"comma-separated subset of {','.join(COLLECTIVES)} (default: all "
                        "those the installed shmtree has)")
    p.add_argument("--mpi-python", metavar="PATH",
                   help="an interpreter with mpi4py (default: this interpreter)")
    p.add_argument("--quick", "--short", action="store_true", help=scaling.QUICK_HELP)


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
        return {"allreduce": commands.cmd_allreduce, "compare": commands.cmd_compare,
                "numa": commands.cmd_numa, "topology": commands.cmd_topology,
                "overlap": commands.cmd_overlap, "multinode": commands.cmd_multinode,
                "scaling": scaling.cmd_scaling, "p2p": p2p.cmd_p2p,
                "split": split.cmd_split, "persistent": persistent.cmd_persistent,
                "torch": torchdist.cmd_torch, "idle": idle.cmd_idle,
                "repro": repro.cmd_repro,
                "survive": survive.cmd_survive}[args.command](args)
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
