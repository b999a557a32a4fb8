"""The one table of ops and dtypes every collective uses, built from the kernels' own
(shmtree._kernels: OP_CODES, UFUNC_CODES, DTYPE_CODES, supported): names and ufuncs to op codes,
dtypes to dtype codes, and the check that a kernel exists for the pair."""
import numpy as np

from . import _kernels

OPS = {**_kernels.OP_CODES, **_kernels.UFUNC_CODES}          # "sum", np.add, ... -> op code
OP_NAMES = {v: k for k, v in _kernels.OP_CODES.items()}
SUPPORTED = [[_kernels.supported(o, d) for d in range(len(_kernels.DTYPE_CODES))]
             for o in range(len(_kernels.OP_CODES))]
_DTYPES: dict = {}                          # dtype -> code, filled as dtypes are seen
_DT_NAMES = {v: k for k, v in _kernels.DTYPE_CODES.items()}


def dtype_code(dtype) -> int:
    code = _DTYPES.get(dtype)
    if code is None:
        code = _DTYPES[dtype] = _kernels.dtype_code(dtype)     # TypeError if unsupported
    return code


def op_code(op) -> int:
    try:
        return OPS[op]
    except (KeyError, TypeError):
        return _kernels.op_code(op)                 # raises ValueError with the details


def reduction_codes(op, dtype):
    """(op code, dtype code) of a reduction, or the local error that explains why there is none:
    ValueError for an unknown op, TypeError for a dtype or pair without a kernel."""
    opc, dtc = op_code(op), dtype_code(dtype)
    if not SUPPORTED[opc][dtc]:
        name = OP_NAMES[opc]
        why = ("bitwise ops take integer and bool dtypes" if name in ("band", "bor", "bxor")
               else "complex numbers have no order" if np.dtype(dtype).kind == "c"
               else "no kernel for this pair")
        raise TypeError(f"shmtree: op {name!r} is not defined for dtype {dtype} ({why})")
    return opc, dtc


def dtype_name(code) -> str:
    name = _DT_NAMES.get(code, "u1")
    return "bfloat16" if name == "bf16" else str(np.dtype(name.replace("b1", "?")))


def dtype_words(dtype) -> str:
    """numpy's name of a dtype (float64, bfloat16, ...), its full form when it has fields."""
    if dtype.fields is None and dtype.subdtype is None:
        name = dtype.name
        if not dtype.isnative and dtype.itemsize > 1:
            name += " (byte-swapped)"
        return name
    return str(dtype)
