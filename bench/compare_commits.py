#!/usr/bin/env python
"""Before/after: shmtree at a baseline commit beside the working tree, measured in one sitting.

Builds the baseline commit in a temporary clone (``git clone -q REPO DIR``, ``git checkout -q
COMMIT``, ``python setup.py build_ext --inplace``), builds the working tree in place, then runs
``shmtree-bench compare --collective C --shared --methods shmtree -n P --sizes ...`` for every
collective, alternately for the baseline (A, "before") and the working tree (B, "after"): each
round runs every collective A then B, so the rounds go A, B, A, B and both trees see the same
machine state.  ``PYTHONPATH`` points each run at its tree (the bench of that tree measures
that tree's library; the commands run from a scratch folder, so nothing else is imported), and
each tree's ``shmtree.__file__`` is checked first.  Each compare measures shmtree on private
arrays (column ``shmtree``), on shared arrays (``comm.empty``: ``shared``) and, in the same
workers, the concurrent memory copy of the same bytes (``copy``): the copy does not depend on
shmtree's code, so its after/before ratio shows how much the machine itself drifted.

Prints the before and the after table (each round's time and the best of the rounds, in us:
max over ranks of the median per call, compare's protocol), then per cell before, after and
after/before (< 1: the working tree is faster), with copy's after/before beside it, and the
geometric mean of after/before for private and for shared arrays.  The JSON documents of every
run and a summary (``summary.json``) are kept in ``--out``.

The full comparison (2 processes, 8 B .. 64 MiB, every collective, private and shared, two
rounds, on an otherwise idle machine: a run takes some minutes):

    python bench/compare_commits.py --base d9b52d0 -n 2 --sizes 8:64M:x8 --rounds 2 \\
        --out bench/results/before-after

A smoke test of the script itself (numbers meaningless):

    python bench/compare_commits.py --sizes 8,32K --iters 1 --rounds 1 --out /tmp/ba

Options: ``--repo`` the repository to clone (default: the one this working tree belongs to),
``--base-dir DIR`` build the baseline there and keep it (reused when it is already that commit
and built), ``--collectives`` a subset, ``--iters``/``--time`` passed to compare,
``--no-build`` use the working tree's in-place build as it is.  Exit status: 0 when every run
succeeded, 1 otherwise.
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TREE = os.path.dirname(HERE)
COLLECTIVES = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter")
ARRAYS = (("private", "shmtree_us"), ("shared", "shared_us"))
TREES = ("before", "after")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="d9b52d0", help="baseline commit (default d9b52d0)")
    p.add_argument("--repo", help="repository to clone (default: this working tree's)")
    p.add_argument("--base-dir", help="build the baseline here and keep it (default: a "
                                      "temporary folder, removed afterwards)")
    p.add_argument("-n", "--nprocs", type=int, default=2, help="processes (default 2)")
    p.add_argument("--sizes", default="8:64M:x8", help="compare --sizes (default 8:64M:x8)")
    p.add_argument("--collectives", default=",".join(COLLECTIVES),
                   help="comma-separated subset (default: all five)")
    p.add_argument("--rounds", type=int, default=2, help="A, B rounds (default 2)")
    p.add_argument("--iters", help="compare --iters (default: compare's adaptive count)")
    p.add_argument("--time", help="compare --time (seconds of timed calls per size)")
    p.add_argument("--out", help="folder for the runs' JSON (default: a new temporary folder)")
    p.add_argument("--no-build", action="store_true",
                   help="do not rebuild the working tree in place")
    args = p.parse_args(argv)
    args.collectives = [c.strip() for c in args.collectives.split(",") if c.strip()]
    bad = [c for c in args.collectives if c not in COLLECTIVES]
    if bad or not args.collectives:
        p.error(f"--collectives: choose from {','.join(COLLECTIVES)}, got {bad}")
    if args.rounds < 1 or args.nprocs < 1:
        p.error("--rounds and --nprocs must be at least 1")
    return args


def git(*argv, cwd=None):
    return subprocess.run(["git", *argv], cwd=cwd, check=True, text=True,
                          capture_output=True).stdout.strip()


def build(tree, log):
    """python setup.py build_ext --inplace in `tree`, output to `log`; SystemExit on failure."""
    print(f"building {tree} (log: {log})", file=sys.stderr, flush=True)
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree,
                              stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        with open(log) as f:
            tail = f.read().splitlines()[-15:]
        raise SystemExit(f"build of {tree} failed (exit {done.returncode}):\n" + "\n".join(tail))


def prepare_base(args, out):
    """The baseline's folder, cloned at args.base and built; (folder, remove afterwards?)."""
    repo = args.repo or git("rev-parse", "--path-format=absolute", "--git-common-dir", cwd=TREE)
    commit = git("rev-parse", "--verify", f"{args.base}^{{commit}}", cwd=TREE)
    folder = args.base_dir or tempfile.mkdtemp(prefix="shmtree-base-")
    temporary = args.base_dir is None
    if os.path.isdir(os.path.join(folder, ".git")):
        if git("rev-parse", "HEAD", cwd=folder) != commit:
            git("checkout", "-q", commit, cwd=folder)
    else:
        if os.path.exists(folder) and os.listdir(folder):
            raise SystemExit(f"--base-dir {folder} exists and is not a clone")
        git("clone", "-q", repo, folder)
        git("checkout", "-q", commit, cwd=folder)
    build(folder, os.path.join(out, "build-before.log"))
    return folder, commit, temporary


def env_for(tree):
    env = dict(os.environ, PYTHONPATH=tree)
    return env


def check_import(tree, scratch):
    """SystemExit unless `python` with PYTHONPATH=tree imports shmtree from `tree`."""
    done = subprocess.run([sys.executable, "-c", "import shmtree, shmtree._engine; "
                           "print(shmtree.__file__)"], cwd=scratch, env=env_for(tree),
                          text=True, capture_output=True)
    where = done.stdout.strip()
    if done.returncode != 0 or not where.startswith(os.path.join(tree, "")):
        raise SystemExit(f"PYTHONPATH={tree} does not import that tree's built shmtree: "
                         f"{where or done.stderr.strip().splitlines()[-1:]}")
    return where


def run_compare(tree, label, collective, rnd, args, out):
    """One shmtree-bench compare in `tree`; its JSON document, or None if it failed."""
    path = os.path.join(out, f"{label}-round{rnd}-{collective}.json")
    cmd = [sys.executable, "-m", "shmtree.bench", "compare", "--collective", collective,
           "--shared", "--methods", "shmtree", "-n", str(args.nprocs), "--sizes", args.sizes,
           "--json", path]
    cmd += ["--iters", args.iters] if args.iters else []
    cmd += ["--time", args.time] if args.time else []
    print(f"[round {rnd}] {label}: {collective}", file=sys.stderr, flush=True)
    done = subprocess.run(cmd, cwd=out, env=env_for(tree), text=True, capture_output=True)
    with open(os.path.join(out, f"{label}-round{rnd}-{collective}.txt"), "w") as f:
        f.write(done.stdout + done.stderr)
    if done.returncode != 0 or not os.path.exists(path):
        print(f"  failed (exit {done.returncode}): "
              + " | ".join(done.stderr.strip().splitlines()[-3:]), file=sys.stderr)
        return None
    with open(path) as f:
        return json.load(f)


def fmt(value, digits=3):
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 10 ** digits else f"{value:.{digits}g}"


def size_text(n):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def table(headers, rows):
    cells = [list(map(str, headers))] + [list(map(str, r)) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def collect(docs):
    """{(collective, size, arrays or 'copy'): {label: [us per round]}} from the runs' rows."""
    cells = {}
    for (label, collective, _), doc in docs.items():
        for row in doc["rows"] if doc else []:
            for arrays, key in ARRAYS + (("copy", "copy_us"),):
                value = row.get(key)
                if value is not None:
                    cells.setdefault((collective, row["size"], arrays), {}).setdefault(
                        label, []).append(value)
    return cells


def best(values):
    return min(values) if values else None


def ratio(after, before):
    return after / before if after is not None and before else None


def report(cells, collectives, rounds):
    keys = sorted((k for k in cells if k[2] != "copy"),
                  key=lambda k: (collectives.index(k[0]), k[1], k[2]))
    for label in TREES:
        print(f"\n# {label}: time per call (us), each round and the best of them")
        lines = []
        for c, s, a in keys:
            got = cells[(c, s, a)].get(label, [])
            lines.append([c, size_text(s), a] + [fmt(v) for v in (got + [None] * rounds)[:rounds]]
                         + [fmt(best(got))])
        print(table(["collective", "size", "arrays"]
                    + [f"round {r + 1}" for r in range(rounds)] + ["best"], lines))
    print("\n# after/before per cell (< 1: the working tree is faster); copy: the memory copy "
          "in the same workers, after/before (how much the machine drifted)")
    lines, logs = [], {"private": [], "shared": []}
    for c, s, a in keys:
        before, after = (best(cells[(c, s, a)].get(t, [])) for t in TREES)
        copy = cells.get((c, s, "copy"), {})
        r = ratio(after, before)
        if r:
            logs[a].append(math.log(r))
        lines.append([c, size_text(s), a, fmt(before), fmt(after), fmt(r, 2),
                      fmt(ratio(best(copy.get("after", [])), best(copy.get("before", []))), 2)])
    print(table(["collective", "size", "arrays", "before (us)", "after (us)", "after/before",
                 "copy after/before"], lines))
    means = {a: math.exp(sum(v) / len(v)) if v else None for a, v in logs.items()}
    print("# geometric mean of after/before: "
          + ", ".join(f"{a} {fmt(m, 3)}" for a, m in means.items()))
    return keys, means


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out = os.path.abspath(args.out or tempfile.mkdtemp(prefix="shmtree-before-after-"))
    os.makedirs(out, exist_ok=True)
    if not args.no_build:
        build(TREE, os.path.join(out, "build-after.log"))
    base, commit, temporary = prepare_base(args, out)
    try:
        trees = {"before": base, "after": TREE}
        for label, tree in trees.items():
            print(f"{label}: {check_import(tree, out)}", file=sys.stderr)
        docs = {}
        for rnd in range(1, args.rounds + 1):
            for collective in args.collectives:
                for label in TREES:
                    docs[(label, collective, rnd)] = run_compare(trees[label], label,
                                                                 collective, rnd, args, out)
    finally:
        if temporary:
            shutil.rmtree(base, ignore_errors=True)
    head = git("rev-parse", "--short", "HEAD", cwd=TREE)
    dirty = " + uncommitted changes" if git("status", "--porcelain", "-uno", cwd=TREE) else ""
    print(f"# before: {commit[:12]} (clone of {args.base}); after: the working tree {TREE} "
          f"(HEAD {head}{dirty})")
    print(f"# shmtree-bench compare --shared --methods shmtree -n {args.nprocs} --sizes "
          f"{args.sizes}" + (f" --iters {args.iters}" if args.iters else "")
          + (f" --time {args.time}" if args.time else "")
          + f"; collectives {','.join(args.collectives)}; {args.rounds} round(s) of A, B; "
          "runs and logs in " + out)
    cells = collect(docs)
    keys, means = report(cells, args.collectives, args.rounds)
    failed = sorted(f"{label} round {rnd} {c}" for (label, c, rnd), d in docs.items() if d is None)
    for line in failed:
        print(f"# failed: {line} (see {out})")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump({"before": commit, "after": f"{head}{dirty}", "nprocs": args.nprocs,
                   "sizes": args.sizes, "rounds": args.rounds, "collectives": args.collectives,
                   "cells": [{"collective": c, "size": s, "arrays": a, **cells[(c, s, a)]}
                             for c, s, a in sorted(cells)],
                   "geomean_after_over_before": means, "failed": failed}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
