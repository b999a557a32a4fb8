"""The bodies of ``shmtree-bench``'s commands (``cli`` parses and dispatches to them) and the
helpers they share: the Plan and group options from the arguments, headlines, size rounding,
results files.

Each ``cmd_<name>(args)`` takes the parsed arguments and returns the exit status; measuring is
done by ``sweep``, ``compare``, ``numa``, ``overlap``, ``multinode``; output by ``report`` and
``plot``.  ``scaling`` (its own module) uses the helpers here.
"""
import os
import sys

from . import compare, machine, multinode, numa, overlap, plot, report, sweep
from .harness import BenchError
from .measure import BLOCKED, MOVES_ONLY, TARGET_S, Plan, whole_bytes
from .units import format_size, parse_dtype

QUICK_TARGET_S = 0.02                       # numa --quick: seconds of timed calls per cell
QUICK_MATRIX_SIZE = 1 << 20                 # numa --quick: bytes per matrix cell


def round_sizes(sizes, dtype, nprocs, collective="allreduce"):
    """(the sizes measured, distinct and sorted; the note saying which sizes changed, or None):
    `sizes` rounded to whole items of `dtype` (and, for the collectives of P blocks:
    allgather, reduce_scatter, alltoall, gather, scatter, P equal blocks of at least one
    item)."""
    whole = {s: whole_bytes(collective, s, dtype, nprocs) for s in sizes}
    changed = {s: w for s, w in whole.items() if s != w}
    measured = sorted(set(whole.values()))
    if not changed:
        return measured, None
    unit = (f"whole {dtype} items ({dtype.itemsize} B each)"
            + (f" in {nprocs} equal blocks" if collective in BLOCKED else ""))
    note = (f"--sizes rounded to {unit}: "
            + ", ".join(f"{format_size(s)} -> {format_size(w)}" for s, w in changed.items()))
    return measured, note


def whole_sizes(args, nprocs, collective="allreduce"):
    """Round --sizes to what is measured (round_sizes), before measuring.  A size that changes
    is said on stderr at once and returned as a '#' line for the output; args.sizes becomes the
    sizes measured (distinct, sorted)."""
    args.sizes, note = round_sizes(args.sizes, args.dtype, nprocs, collective)
    if note is None:
        return None
    print(f"shmtree-bench: note: {note}", file=sys.stderr)
    return f"# {note}"


def plan_of(args, nprocs):
    rotation = machine.rotation_bytes(nprocs) if args.fresh else 0
    target = args.time
    if target is None:
        target = QUICK_TARGET_S if getattr(args, "quick", False) else TARGET_S
    return Plan(dtype=args.dtype, op=args.op, iters=args.iters, target_s=target,
                fresh=args.fresh, rotation_bytes=rotation, timeout=args.timeout)


def options_of(args):
    return sweep.group_options(**{k: getattr(args, k, None) for k in sweep.GROUP_OPTIONS})


def progress_of(args):
    return sys.stderr.isatty() if args.progress is None else args.progress


def settings_of(args, nprocs, plan, **extra):
    """The command's options as recorded in JSON (everything needed to rerun it)."""
    return {"argv": args.argv, "nprocs": nprocs,
            "sizes": args.sizes, "plan": plan.as_dict(), "group_options": options_of(args),
            **extra}


def usable():
    return len(os.sched_getaffinity(0))


def headline(what, nprocs, plan, options, with_op=True):
    knobs = ", ".join(f"{k}={v}" for k, v in options.items()) or "default group options"
    buffers = "cache-cold buffers (--fresh)" if plan.fresh else "warm buffers"
    op = f" {plan.op}" if with_op else ""
    return (f"# shmtree {machine.shmtree_version()} {what}: {nprocs} processes, {plan.dtype}"
            f"{op}, {knobs}, {buffers}\n# time = max over ranks of the median per call")


def shmtree_failure(exc):
    """A failure inside shmtree.run (or its import) as the bench's own error."""
    return BenchError(f"shmtree: {type(exc).__name__}: {exc}")


def write_outputs(args, doc, columns, rows):
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
    nprocs = args.nprocs or usable()
    plan, options = plan_of(args, nprocs), options_of(args)
    rounded = whole_sizes(args, nprocs)
    try:
        measured = sweep.run_sweep(args.sizes, nprocs, plan, options, True, progress_of(args))
    except Exception as exc:
        raise shmtree_failure(exc) from exc
    rows = [sweep.row(s, plan.dtype, nprocs, m["allreduce"], m["copy"])
            for s, m in measured.items()]
    print(headline("allreduce", nprocs, plan, options))
    if rounded:
        print(rounded)
    print(report.table(
        ["size", "count", "time (us)", "algbw (GB/s)", "busbw (GB/s)", "copy (us)", "vs copy",
         "iters"],
        [[format_size(r["size"]), r["count"], report.fmt(r["time_us"]),
          report.fmt(r["algbw_gbs"]), report.fmt(r["busbw_gbs"]), report.fmt(r["copy_us"]),
          report.fmt(r["vs_copy"]) + "x", r["iters"]] for r in rows]))
    doc = report.document("allreduce", machine.describe(args.topology),
                          settings_of(args, nprocs, plan), SWEEP_COLUMNS, rows)
    write_outputs(args, doc, list(SWEEP_COLUMNS), rows)
    if args.plot:
        plot.plot_sweep(args.plot, rows, f"shmtree allreduce, P={nprocs}, {plan.dtype} {plan.op}")
    return 0


COMPARE_TITLES = {"allreduce": "allreduce", "broadcast": "broadcast (root 0)",
                  "reduce": "reduce (root 0)", "allgather": "allgather",
                  "reduce_scatter": "reduce_scatter", "alltoall": "alltoall",
                  "alltoallv": "alltoallv (alltoall with counts=)",
                  "gather": "gather (root 0)", "scatter": "scatter (root 0)", "scan": "scan",
                  "exscan": "exscan"}
WHOLE_BUFFER = {
    "allgather": "# size = the whole gathered result (P blocks of size/P), as in nccl-tests",
    "reduce_scatter": "# size = the whole input (P blocks of size/P) each rank reduces, as in "
                      "nccl-tests",
    "alltoall": "# size = each rank's whole input (P blocks of size/P, one per rank; the "
                "output is as large), as in nccl-tests",
    "alltoallv": "# size = each rank's whole input (counts: P equal blocks of size/P, one per "
                 "rank; the output is as large), as in nccl-tests",
    "gather": "# size = the root's whole gathered result (P blocks of size/P), as in "
              "nccl-tests",
    "scatter": "# size = the root's whole input (P blocks of size/P), as in nccl-tests",
}


def cmd_compare(args):
    nprocs = args.nprocs or 2
    plan, options = plan_of(args, nprocs), options_of(args)
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
    rounded = whole_sizes(args, nprocs, collective)
    columns, copy = compare.run_all(args.sizes, nprocs, plan, options, methods, pythons,
                                    progress_of(args), collective)
    rows = compare.rows(args.sizes, plan.dtype, columns, copy, collective, nprocs)
    title = COMPARE_TITLES[collective]
    print(headline(f"compare {title}", nprocs, plan, options,
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
        settings_of(args, nprocs, plan, methods=methods, mpi_pythons=pythons,
                  collective=collective),
        {"size": "message bytes (the whole buffer)", "count": "elements",
         "<method>_us": "time per call", "<method>_vs_shmtree": "that time / shmtree_us",
         "shmtree_vs_copy": "shmtree_us / copy_us"},
        rows, collective=collective,
        methods={c.key: c.meta() for c in compare.everything(columns, copy)})
    write_outputs(args, doc, sorted({k for r in rows for k in r}, key=_column_order), rows)
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
    nprocs = args.nprocs or usable()
    plan, options = plan_of(args, nprocs), options_of(args)
    if args.quick:
        args.sizes = args.sizes[:1]
    rounded = whole_sizes(args, nprocs)
    if args.matrix_size is None:
        args.matrix_size = QUICK_MATRIX_SIZE if args.quick else 64 << 20
    cells = len([n for n, cpus in machine.numa_nodes().items() if cpus]) ** 2
    bar = report.Progress(cells + len(numa.VARIANTS), "numa", progress_of(args))
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
    print(headline("allreduce time (us) per knob", nprocs, plan, options))
    if rounded:
        print(rounded)
    print(numa_variants_text(rows))
    doc = report.document(
        "numa", machine.describe(args.topology),
        settings_of(args, nprocs, plan, matrix_size=args.matrix_size, quick=args.quick),
        {"group": "knob", "variant": "its value", "size": "message bytes",
         "time_us": "allreduce time", "busbw_gbs": "bus bandwidth", "error": "why it failed"},
        rows, matrix=mat, note=note)
    write_outputs(args, doc, ["group", "variant", "size", "count", "time_us", "busbw_gbs", "error"],
                  rows)
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
    options = options_of(args)
    try:
        import shmtree
        from shmtree.machine.plan import plan_group
        topo = shmtree.Topology.resolve(args.topology)
        nprocs = args.nprocs or (topo.ncpus if args.topology else usable())
        group_plan = plan_group(nprocs, **options)
        text = group_plan.describe()
    except Exception as exc:
        raise shmtree_failure(exc) from exc
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
    rounded = whole_sizes(args, args.nprocs)
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
    options = options_of(args)
    try:
        got = overlap.run_overlap(args.nprocs, args.size, args.repeats, computes, args.posts,
                                  options)
    except Exception as exc:
        raise shmtree_failure(exc) from exc
    knobs = ", ".join(f"{k}={v}" for k, v in options.items()) or "default group options"
    print(f"# shmtree {machine.shmtree_version()} overlap: {args.nprocs} processes, {knobs}, "
          f"{usable()} usable cores; every figure the slowest rank's median")
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
