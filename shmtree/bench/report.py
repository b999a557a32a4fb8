"""Everything the bench prints or writes: tables, progress, JSON and CSV files.

Tables are plain text, right-aligned, one header line and a rule, readable in a terminal and in
an issue.  Progress goes to stderr, and only when stderr is a terminal (or when asked), so that
piped output and results files stay clean.

A JSON results file describes itself: ``tool``, ``schema``, ``command``, the machine
(``machine.describe()``: host, date, CPU model, NUMA nodes, shmtree's topology description,
versions), the command's ``options``, ``columns`` (name -> meaning) and ``rows``; commands add
their own sections (``matrix`` for numa).  Files are written to a temporary name and renamed, so
an interrupted run never leaves half a file.
"""
import csv
import json
import math
import os
import sys

from .units import format_size

SCHEMA = 1


class Progress:
    """"[k/n] what size" on one stderr line, rewritten in place; silent unless enabled."""

    def __init__(self, total, what, enabled=None):
        self.total, self.what, self.k = total, what, 0
        self.enabled = sys.stderr.isatty() if enabled is None else enabled

    def step(self, size, note=""):
        self.k += 1
        if self.enabled:
            text = f"[{self.k}/{self.total}] {self.what} {format_size(size)} {note}".rstrip()
            sys.stderr.write("\r\x1b[K" + text)
            sys.stderr.flush()

    def done(self):
        if self.enabled:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


def fmt(value, digits=3):
    """Numbers for tables: 3 significant digits, thousands unabridged; strings pass through."""
    if isinstance(value, str):
        return value
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, int):
        return str(value)
    if abs(value) >= 10 ** digits:
        return f"{value:.0f}"
    return f"{value:.{digits}g}"


def table(headers, rows):
    """Right-aligned text table; rows are lists of already-formatted cells."""
    cells = [list(map(str, headers))] + [list(map(str, r)) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def document(command, machine, options, columns, rows, **sections):
    """The self-describing JSON document of one command's results."""
    doc = {"tool": "shmtree-bench", "schema": SCHEMA, "command": command}
    doc.update(machine)
    doc.update(options=options, columns=columns, rows=rows)
    doc.update(sections)
    return doc


def write_json(path, doc):
    _atomic(path, lambda f: (json.dump(doc, f, indent=2, sort_keys=False, default=_plain),
                             f.write("\n")))


def write_csv(path, columns, rows):
    """One line per row, the given columns in order (nested values flattened as JSON)."""
    def emit(f):
        w = csv.writer(f)
        w.writerow(columns)
        for r in rows:
            w.writerow([_csv_cell(r.get(c)) for c in columns])
    _atomic(path, emit, newline="")


def _csv_cell(value):
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return "" if value is None else value


def _plain(value):
    """json.dump fallback: numpy scalars and anything else with a plain equivalent."""
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def _atomic(path, write, newline=None):
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w", newline=newline) as f:
            write(f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
