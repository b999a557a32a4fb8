"""ProcessGroupShmtree's gathers and scatters (a mixin of the backend class, backend.py)."""
from __future__ import annotations

import numpy as np
import torch

from ..frontend import calls
from ..codes import KIND_ALLTOALL
from ..errors import CollectiveMismatchError
from .options import (ArgumentError, _AllgatherOptions, _GatherOptions, _OP, _ROOT,
                      _ReduceScatterOptions, _ScatterOptions, _TIMEOUT, _check_avg, _form,
                      _invalid, _invalid_value, _op, _seconds)
from .tensors import (_Tensor, _blocks_of_one, _check_dense, _check_match, _check_root,
                      _check_root_list, _check_splits, _flat, _shaped, _size_text, _tensor_lists,
                      _tensors, _view)
from .works import _call


class _Gathers:
    """ProcessGroupShmtree's gathers and scatters: all_gather, reduce_scatter (and their
    single-tensor forms), gather, scatter, all_to_all (shmtree's allgather, reduce_scatter,
    gather, scatter and alltoall)."""

    def allgather(self, output_tensors, input_tensors, opts=None, *args, **kwargs):
        """allgather(output_lists, input_tensors, opts) and allgather(output_tensors,
        input_tensor, timeout=None).  n inputs fill each of n output lists of n*size tensors:
        rank r's input j is entry r*n+j (gloo's); the future's value is the one output list
        for n = 1, the list of them otherwise."""
        what = "allgather"
        if type(opts) is not _AllgatherOptions or args or kwargs:
            opts = _form(opts, args, kwargs, _AllgatherOptions, what, (_TIMEOUT,))
        if isinstance(input_tensors, _Tensor):     # the convenience form
            output_tensors, input_tensors = [_tensors(output_tensors, what, "output_tensors")], \
                [input_tensors]
        else:
            output_tensors = _tensor_lists(output_tensors, what, "output_tensors")
            input_tensors = _tensors(input_tensors, what, "input_tensors")
        secs = _seconds(opts.timeout, self._timeout)
        comm, size = self._comm, self._comm.size
        n = len(input_tensors)
        if n == 0:
            raise _invalid(what, "requires non-empty input tensor list")
        if len(output_tensors) != n:
            raise _invalid(what, "requires input/output tensor lists to have the same length")
        for i, outs in enumerate(output_tensors):
            if len(outs) != n * size:
                raise _invalid(what, f"invalid output tensor list at index {i} (expected length "
                                     f"{n * size}, got {len(outs)})")
        _check_dense(what, input_tensors)
        _check_match(what, input_tensors)
        first = input_tensors[0]
        bad = None                      # outputs that do not fit the input (said below)
        for outs in output_tensors:
            _check_dense(what, outs)
            try:
                _check_match(what, outs, first.dtype, first.shape)
            except RuntimeError as exc:
                bad = bad or exc
        if n == 1:
            a = _view(first)
        else:
            for t in input_tensors:
                _view(t)
            a = _view(torch.stack([t.detach() for t in input_tensors]))
        if bad is not None:
            raise self._gather_refused(bad, a, secs, first)
        gathered = torch.empty((size,) + tuple(a.shape), dtype=first.dtype)
        g = _view(gathered)
        every = gathered.view((size * n,) + tuple(first.shape))

        def finish():
            for outs in output_tensors:
                for k, o in enumerate(outs):
                    o.detach().copy_(every[k])
            return output_tensors[0] if n == 1 else output_tensors
        return self._work([_call(calls.allgather, comm, a, out=g, timeout=secs)], g.nbytes,
                          finish)

    def _allgather_base(self, output, input, opts=None):
        """all_gather_into_tensor: output holds size copies' room, dim 0 rank-major."""
        what = "all_gather_into_tensor"
        comm, size = self._comm, self._comm.size
        secs = _seconds(getattr(opts, "timeout", None), self._timeout)
        if output.dtype != input.dtype:
            raise self._gather_refused(
                _invalid(what, f"invalid tensor type at index 0 (expected {input.dtype}, got "
                               f"{output.dtype})"), _view(input), secs, input)
        if output.numel() != size * input.numel():
            raise self._gather_refused(
                _invalid(what, f"invalid tensor size at index 0 (expected {size} x "
                               f"{_size_text(input)}, got {_size_text(output)})"),
                _view(input), secs, input)
        out, put = _shaped(output, (size,) + tuple(input.shape), what)

        def finish():
            if put is not None:
                put()
            return list(output.chunk(size)) if output.dim() else [output]
        return self._work([_call(calls.allgather, comm, _view(input), out=out, timeout=secs)],
                          out.nbytes, finish)

    def _gather_refused(self, error, a, secs, like):
        """An all_gather whose outputs do not fit this rank's input `a` (error: gloo's
        RuntimeError for that; returned to raise, an ArgumentError with its words).  The input
        is gathered all the same first, into a temporary (blocking): the other ranks'
        all_gather takes part with it, so none waits for this rank, and the error says what
        every rank passed - when their inputs differ (tensor sizes that differ by rank) every
        rank's all_gather fails naming each rank's shape and dtype, and so does this one's
        error; else it names the one shape and dtype they share."""
        comm = self._comm
        self._check_failed()
        tmp = np.empty((comm.size,) + tuple(a.shape), a.dtype)
        theirs = None
        with self._issuing:
            self._post_lazy()
            try:
                _call(calls.allgather, comm, a, out=tmp, timeout=secs)(True)()
            except CollectiveMismatchError as exc:
                theirs = exc
            except Exception as exc:              # (a dead peer, a timeout: said with it)
                return RuntimeError(f"{error} (and gathering every rank's input to compare "
                                    f"failed: {type(exc).__name__}: {exc})")
        if theirs is not None:
            said = str(theirs).split("ranks disagree on the collective call: ", 1)[-1]
            return ArgumentError(f"{error}: all_gather takes tensors of one shape and dtype on "
                                 f"every rank, and the ranks' differ: {said}")
        return ArgumentError(f"{error} (every rank's input has shape {_size_text(like)} and "
                             f"dtype {like.dtype}: each output tensor must have them)")

    def _said(self, error, kind, name, secs):
        """A local error of an operation that the other ranks make with arguments that may
        be right (error: returned, to raise): said in the call's round first (their call then
        raises a CollectiveMismatchError naming this rank's error: none waits for this rank;
        ranks that all made an error each raise their own)."""
        comm = self._comm
        if comm.size > 1 and not self._group.aborted():
            spec = calls.CallSpec(name, getattr(calls, name.upper()), kind, error=error,
                                  timeout=secs, deadline=calls.deadline_of(secs))
            with self._issuing:
                self._post_lazy()
                try:
                    comm._start(spec)             # (raises `error`, once said)
                except Exception:
                    pass
        return error

    def reduce_scatter(self, output_tensors, input_tensors, opts=None, *args, **kwargs):
        """reduce_scatter(outputs, input_lists, opts) and reduce_scatter(output, inputs,
        op=SUM, timeout=None): rank r's output gets the reduction of every rank's inputs[r];
        the inputs' sizes may differ (rank r's output has inputs[r]'s)."""
        what = "reduce_scatter"
        if type(opts) is not _ReduceScatterOptions or args or kwargs:
            opts = _form(opts, args, kwargs, _ReduceScatterOptions, what, (_OP, _TIMEOUT))
        if isinstance(output_tensors, _Tensor):    # the convenience form
            output_tensors, input_tensors = [output_tensors], [_tensors(input_tensors, what)]
        else:
            output_tensors = _tensors(output_tensors, what, "output_tensors")
            input_tensors = _tensor_lists(input_tensors, what, "input_tensors")
        red = _op(opts.reduceOp)
        secs = _seconds(opts.timeout, self._timeout)
        comm, size, rank = self._comm, self._comm.size, self._comm.rank
        if len(output_tensors) != 1:
            raise _invalid(what, "reduce_scatter only supports 1 output")
        if len(input_tensors) != 1:
            raise _invalid(what, "requires input/output tensor lists to have the same length")
        out, parts = output_tensors[0], input_tensors[0]
        if len(parts) != size:
            raise _invalid(what, "invalid input tensor list size, must be world size")
        _check_dense(what, [out] + parts)
        for i, p in enumerate(parts):
            if p.dtype != out.dtype:
                raise _invalid(what, f"invalid tensor type at index {i} (expected {out.dtype}, "
                                     f"got {p.dtype})")
        if out.numel() != parts[rank].numel():
            raise _invalid(what, f"invalid tensor size: the output has {out.numel()} elements, "
                                 f"this rank's input {parts[rank].numel()}")
        _check_avg(red, [out], what)
        for p in parts:
            _view(p)
        counts = [p.numel() for p in parts]
        base = "sum" if red == "avg" else red
        if len(set(counts)) == 1:
            whole = torch.cat([_flat(p) for p in parts])
            o, put = _shaped(out, (out.numel(),), what)
        else:                                     # uneven: each part padded to the longest
            longest = max(counts)
            whole = torch.zeros((size, longest), dtype=out.dtype)
            for k, p in enumerate(parts):
                whole[k, :counts[k]] = _flat(p)
            block = torch.empty((1, longest), dtype=out.dtype)
            o = _view(block)

            def put():
                out.detach().copy_(block[0, :counts[rank]].view(out.shape))
        w = _view(whole)

        def finish():
            if put is not None:
                put()
            return self._divide(output_tensors, red)
        return self._work([_call(calls.reduce_scatter, comm, w, base, out=o, timeout=secs,
                                 **self._reproducibly(red))], w.nbytes, finish)

    def _reduce_scatter_base(self, output, input, opts=None):
        """reduce_scatter_tensor: input holds size blocks of output's size, dim 0 rank-major."""
        what = "reduce_scatter_tensor"
        if type(opts) is not _ReduceScatterOptions:
            opts = _form(opts, (), {}, _ReduceScatterOptions, what, (_OP, _TIMEOUT))
        red, comm = _op(opts.reduceOp), self._comm
        if output.dtype != input.dtype:
            raise _invalid(what, f"invalid tensor type (expected {input.dtype}, got "
                                 f"{output.dtype})")
        if input.numel() != comm.size * output.numel():
            raise _invalid(what, f"invalid tensor size: the input has {input.numel()} elements, "
                                 f"expected {comm.size} x {output.numel()}")
        _check_avg(red, [output], what)
        a = _view(input).reshape(comm.size, -1) if input.is_contiguous() \
            else _view(input.reshape(comm.size, -1))
        out, put = _shaped(output, (1, output.numel()), what)

        def finish():
            if put is not None:
                put()
            return self._divide([output], red)
        return self._work([_call(calls.reduce_scatter, comm, a, "sum" if red == "avg" else red,
                                 out=out, timeout=_seconds(opts.timeout, self._timeout),
                                 **self._reproducibly(red))], a.nbytes, finish)

    all_gather_single = _allgather_base          # (the names torch >= 2.10 calls)
    reduce_scatter_single = _reduce_scatter_base

    # ---- gather, scatter, all_to_all: shmtree's gather, scatter and alltoall ----

    def gather(self, output_tensors, input_tensors, opts=None, *args, **kwargs):
        """gather(output_lists, inputs, opts) and gather(outputs, input, root, timeout=None):
        the root's output_lists[0][r] gets rank r's inputs[0]; the others pass no output
        (gloo's checks).  One shmtree gather; the future's value is the output lists on the
        root, [] elsewhere."""
        what = "gather"
        if type(opts) is not _GatherOptions or args or kwargs:
            opts = _form(opts, args, kwargs, _GatherOptions, what, (_ROOT, _TIMEOUT))
        comm, size, rank = self._comm, self._comm.size, self._comm.rank
        root = opts.rootRank
        if isinstance(input_tensors, _Tensor):     # the convenience form
            outs = _tensors(output_tensors, what, "output_tensors") \
                if output_tensors is not None else []
            output_tensors, input_tensors = ([outs] if outs or rank == root else []), \
                [input_tensors]
        else:
            output_tensors = _tensor_lists(output_tensors, what, "output_tensors")
            input_tensors = _tensors(input_tensors, what, "input_tensors")
        _check_root(what, root, size)
        if len(input_tensors) != 1:
            raise _invalid(what, "requires a single-element input tensor list")
        _check_dense(what, input_tensors)
        inp = input_tensors[0]
        if rank == root:
            _check_root_list(what, output_tensors, "output", ".", size, inp)
        elif output_tensors:
            raise _invalid(what, "requires empty output on non-root")
        a = _view(inp)
        gathered = direct = None
        if rank == root:                           # (into the outputs when they are one
            direct = _blocks_of_one(output_tensors[0], avoid=inp)   # buffer's blocks)
            gathered = direct if direct is not None else \
                torch.empty((size,) + tuple(inp.shape), dtype=inp.dtype)

        def finish():
            if gathered is None:
                return []
            if direct is None:
                for r, o in enumerate(output_tensors[0]):
                    o.detach().copy_(gathered[r])
            return output_tensors[0]
        return self._work([_call(calls.gather, comm, a, root,
                                 out=_view(gathered) if gathered is not None else None,
                                 timeout=_seconds(opts.timeout, self._timeout))],
                          a.nbytes * (size if rank == root else 1), finish)

    def scatter(self, output_tensors, input_tensors, opts=None, *args, **kwargs):
        """scatter(outputs, input_lists, opts) and scatter(output, inputs, root, timeout=None):
        rank r's outputs[0] gets the root's input_lists[0][r]; the others pass no input (gloo's
        checks).  One shmtree scatter; the future's value is the outputs."""
        what = "scatter"
        if type(opts) is not _ScatterOptions or args or kwargs:
            opts = _form(opts, args, kwargs, _ScatterOptions, what, (_ROOT, _TIMEOUT))
        comm, size, rank = self._comm, self._comm.size, self._comm.rank
        root = opts.rootRank
        if isinstance(output_tensors, _Tensor):    # the convenience form
            ins = _tensors(input_tensors, what, "input_tensors") \
                if input_tensors is not None else []
            output_tensors, input_tensors = [output_tensors], \
                ([ins] if ins or rank == root else [])
        else:
            output_tensors = _tensors(output_tensors, what, "output_tensors")
            input_tensors = _tensor_lists(input_tensors, what, "input_tensors")
        _check_root(what, root, size)
        if len(output_tensors) != 1:
            raise _invalid(what, "requires a single-element output tensor list")
        _check_dense(what, output_tensors)
        out_t = output_tensors[0]
        whole = None
        if rank == root:
            _check_root_list(what, input_tensors, "input", "", size, out_t)
            whole = _blocks_of_one(input_tensors[0])     # (one buffer's blocks: no copy)
            if whole is None:
                whole = torch.stack([t.detach() for t in input_tensors[0]])
        elif input_tensors:
            raise _invalid(what, "requires empty input on non-root")
        out, put = _shaped(out_t, tuple(out_t.shape), what)

        def finish():
            if put is not None:
                put()
            return output_tensors
        return self._work([_call(calls.scatter, comm, _view(whole) if whole is not None
                                 else None, root, out=out,
                                 timeout=_seconds(opts.timeout, self._timeout))],
                          out.nbytes * (size if rank == root else 1), finish)

    def alltoall_base(self, output, input, output_split_sizes=None, input_split_sizes=None,
                      opts=None):
        """all_to_all_single: input's dim 0 split among the ranks (equally, or by
        input_split_sizes), output's dim 0 filled in source-rank order (equally, or by
        output_split_sizes).  Equal splits: one shmtree alltoall of (size, block) views;
        uneven: alltoall(counts=) of the rows (dim 0)."""
        what = "alltoall_base"
        comm, size = self._comm, self._comm.size
        out_s = [int(n) for n in (output_split_sizes or [])]
        in_s = [int(n) for n in (input_split_sizes or [])]
        secs = _seconds(getattr(opts, "timeout", None), self._timeout)
        try:                            # (each rank sees only its own: said in the round)
            _check_dense(what, [output])
            _check_dense(what, [input])
            if output.dtype != input.dtype:
                raise _invalid(what, f"invalid tensor type (expected {input.dtype}, got "
                                     f"{output.dtype})")
            if input.dim() == 0 or output.dim() == 0:
                raise _invalid(what, "the input and the output need at least one dimension")
            if not input.is_contiguous():
                raise _invalid_value(what, "Tensors must be contiguous (the input is not: as "
                                           "gloo, all_to_all_single takes a contiguous input; "
                                           "pass input.contiguous())")
            _check_splits(what, in_s, input, size, "input")
            _check_splits(what, out_s, output, size, "output")
            if not in_s and not out_s and output.numel() != input.numel():
                raise _invalid(what, f"invalid tensor size: the output has {output.numel()} "
                                     f"elements, the input {input.numel()}")
        except (RuntimeError, ValueError) as exc:
            raise self._said(exc, KIND_ALLTOALL, "alltoall", secs) from None
        inner = 1
        for n in input.shape[1:]:
            inner *= int(n)
        if not in_s and not out_s:
            a = _view(input).reshape(size, -1)
            out, put = _shaped(output, (size, output.numel() // size), what)
            counts = None
        else:
            rows = int(input.shape[0])
            counts = in_s or [rows // size] * size
            a = _view(input).reshape(rows, inner)
            out, put = _shaped(output, (int(output.shape[0]), inner), what)

        def finish():
            if put is not None:
                put()
            return [output]
        return self._work([_call(calls.alltoall, comm, a, counts, out=out, timeout=secs)],
                          max(a.nbytes, out.nbytes), finish)

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors, input_tensors, opts=None):
        """all_to_all of lists: rank r's output_tensors[s] gets rank s's input_tensors[r] (any
        sizes, one dtype): one shmtree alltoall(counts=) of the elements."""
        what = "alltoall"
        comm, size = self._comm, self._comm.size
        outputs = _tensors(output_tensors, what, "output_tensors")
        inputs = _tensors(input_tensors, what, "input_tensors")
        if len(inputs) != size or len(outputs) != size:
            raise _invalid(what, f"requires input and output lists of the group's size {size} "
                                 f"(got {len(inputs)} inputs, {len(outputs)} outputs)")
        _check_dense(what, inputs)
        _check_dense(what, outputs)
        dtype = inputs[0].dtype
        for i, t in enumerate(inputs + outputs):
            if not isinstance(t, _Tensor):
                raise TypeError(f"shmtree: ProcessGroupShmtree.{what}: expected a torch.Tensor, "
                                f"got {type(t).__name__}")
            if t.dtype != dtype:
                raise _invalid(what, f"invalid tensor type at index {i % size} (expected "
                                     f"{dtype}, got {t.dtype})")
            _view(t)
        flat = torch.cat([_flat(t) for t in inputs])
        got = torch.empty(sum(o.numel() for o in outputs), dtype=dtype)
        g = _view(got)

        def finish():
            for o, piece in zip(outputs, got.split([o.numel() for o in outputs])):
                o.detach().copy_(piece.view(o.shape))
            return outputs
        return self._work([_call(calls.alltoall, comm, _view(flat),
                                 [t.numel() for t in inputs], out=g,
                                 timeout=_seconds(getattr(opts, "timeout", None),
                                                  self._timeout))],
                          max(g.nbytes, flat.numel() * flat.element_size()), finish)
