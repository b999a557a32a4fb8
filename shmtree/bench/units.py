"""Sizes, dtypes and ops as the command line spells them.

Sizes are byte counts written the way people write them: "8", "4K", "1.5M", "64MiB", "2G"
(powers of 1024), comma-separated lists ("8,1K,64M") or geometric ranges "START:END:xF"
("8:64M:x8" is 8 B, 64 B, 512 B, ... and always ends with END itself).  This module turns those
strings into integers and back, and checks dtype and op names before any process starts, so a
typo costs an error message, not a half-finished sweep.
"""
import re

import numpy as np

from .measure import UFUNCS

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+)\s*([KMGT]?)(I?B)?\s*$", re.IGNORECASE)

# the ops the bench measures: the names of measure.UFUNCS, the bench's one op table (names as in
# shmtree._kernels.OP_CODES, ufuncs as in its UFUNC_CODES; tests/test_bench.py checks that they
# agree).  Not imported from shmtree._kernels: the bench parses, and runs its baselines, without
# shmtree's compiled parts (shmtree/bench/__init__.py).  The arithmetic ops only: every column
# (MPI, gloo, numpy) has them.
OPS = tuple(UFUNCS)


def parse_size(text):
    """One size: "64M" -> 67108864.  Raises ValueError on anything else."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 8, 4K, 2M, 64MiB)")
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if value < 0:
        raise ValueError(f"a size cannot be negative: {text!r}")
    if value != int(value):
        raise ValueError(f"not a whole number of bytes: {text!r}")
    return int(value)


def parse_range(text):
    """"START:END:xF" -> [START, START*F, ..., END] (END included even off the grid)."""
    parts = text.split(":")
    if len(parts) != 3 or not parts[2].lower().startswith("x"):
        raise ValueError(f"a size range is START:END:xFACTOR, got {text!r}")
    start, end = parse_size(parts[0]), parse_size(parts[1])
    factor = float(parts[2][1:])
    if start <= 0 or end < start or factor <= 1:
        raise ValueError(f"bad size range {text!r}: need 0 < START <= END and FACTOR > 1")
    sizes, size = [], start
    while size < end:
        sizes.append(int(size))
        size *= factor
    sizes.append(end)
    return sorted(set(sizes))


def parse_sizes(text):
    """A comma-separated mix of sizes and ranges -> sorted list of distinct byte counts, each at
    least 1 byte (a message of 0 bytes is not measured: it is refused, not rounded up to one
    element)."""
    sizes = set()
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if ":" in item:
            sizes.update(parse_range(item))
            continue
        size = parse_size(item)
        if size < 1:
            raise ValueError(f"a message size must be at least 1 byte, got {item!r}")
        sizes.add(size)
    if not sizes:
        raise ValueError("no sizes given")
    return sorted(sizes)


def format_size(nbytes):
    """67108864 -> "64 MiB"; 1536 -> "1.5 KiB"; 8 -> "8 B".  A size that is not a multiple of
    a thousandth of its unit is written in bytes: 1048572 (1 MiB rounded down to 3 blocks) ->
    "1048572 B", never "1 MiB" nor "1.02e+03 KiB"."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            if value == int(value):
                return f"{value:.0f} {unit}"
            if (value * 1000) == int(value * 1000):
                return f"{value:.3f}".rstrip("0") + f" {unit}"
            break
    return f"{nbytes} B"


def parse_dtype(name):
    """A numpy dtype name ("float32", "f4", "int64", "bool") -> np.dtype."""
    try:
        dtype = np.dtype(name)
    except TypeError as exc:
        raise ValueError(f"unknown dtype {name!r}") from exc
    if dtype.kind not in "biufc" or dtype.itemsize > 16:
        raise ValueError(f"dtype {name!r} is not a numeric dtype an allreduce can take")
    return dtype


def parse_op(name):
    """One of OPS: "sum" | "prod" | "min" | "max" (case-insensitive) -> the canonical name."""
    op = name.lower()
    if op not in OPS:
        raise ValueError(f"unknown op {name!r}: choose one of {', '.join(OPS)}")
    return op


def count_for(nbytes, dtype):
    """Number of elements of an nbytes message (at least one element)."""
    return max(1, nbytes // np.dtype(dtype).itemsize)
