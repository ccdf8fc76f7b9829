"""shard_map: per-rank code over named mesh axes, the manual counterpart of pjit.

``fn`` sees this rank's shards (laid out by ``in_specs``) and communicates through
``sharded.collectives``. Its outputs are this rank's blocks of the results, laid out by
``out_specs``; with ``check_vma`` an output that still varies over an axis its spec
does not name is rejected.

Two ways to run, as in JAX:

- **Inside a function that pjit traces**, the body is traced once into a region of
  the global program (NOTE [shard_map in a traced program] in sharded/_region.py), so
  it composes with torch.func (grad of any order, vmap inside the body) and with
  automatically partitioned code around it.
- **Eagerly** (outside pjit), the body runs op by op on this rank's shards with real
  collectives, so Python control flow on a collective's result is allowed, as long as
  that value is the same on every rank. ``.lower(*args)`` traces it as pjit would.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
from torch.distributed.tensor import DTensor

from sharded import _manual, _region, _torch, _tree, sync
from sharded.data import value_digests
from sharded.mesh import Mesh, current_mesh
from sharded.modes._expand import contiguous_strides
from sharded.random.rewrite import RNG_STATE_OP
from sharded.spec import AUTO, P, axes_of_dim, check_spec, local_shape, to_placements
from sharded._trace import in_global_trace
from sharded._arguments import check_on_mesh
from sharded._pjit import Pjit
from sharded._program import local_input


def shard_map(fn: Callable | None = None, /, *, mesh: Mesh | None = None, in_specs,
              out_specs, check_vma: bool = True):
    """Map ``fn`` over the shards of its arguments (see the module docstring).

    - ``in_specs``: a pytree prefix of the positional args (P or None leaves).
    - ``out_specs``: a pytree prefix of the outputs. An axis an out_spec does not
      name means the output is the same on every rank along it; an axis it names
      that the output does not vary over tiles copies of it (the transpose sums
      their cotangents).
    - ``check_vma``: reject outputs that may vary over an axis their spec does not
      name. With False the user vouches that they do not (their gradient is that of
      a value the same on every rank).
    """
    if fn is None:
        return functools.partial(shard_map, mesh=mesh, in_specs=in_specs,
                                 out_specs=out_specs, check_vma=check_vma)
    return ShardMap(fn, mesh, in_specs, out_specs, check_vma)


class ShardMap:
    def __init__(self, fn, mesh, in_specs, out_specs, check_vma):
        name = f"shard_map({getattr(fn, '__name__', type(fn).__name__)})"
        for what, specs in (("in_specs", in_specs), ("out_specs", out_specs)):
            if any(x is AUTO for x in _tree.spec_leaves(specs)):
                raise ValueError(
                    f"{name}: {what} holds AUTO; a shard_map body is per-rank code, written "
                    f"for the layouts its specs name, so they are given by hand. AUTO is "
                    f"pjit's: pjit(step, in_specs=AUTO, ...) lays out the values around the "
                    f"shard_map, which takes them in its own specs.")
        self.fn = fn
        self.mesh = mesh
        self.in_specs = in_specs
        self.out_specs = out_specs
        self.check_vma = check_vma
        self.name = f"shard_map({getattr(fn, '__name__', type(fn).__name__)})"
        self._lowered: dict[int, Pjit] = {}
        # Name and docs only: a __wrapped__ attribute would let torch.func (and
        # inspect) call the raw function, bypassing this wrapper.
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, *args):
        mesh = current_mesh(self.mesh, self.name)
        if _manual.active() is not None:
            raise NotImplementedError(f"{self.name}: shard_map inside a shard_map body is not supported.")
        if in_global_trace():
            return self._emit(mesh, args)
        return self._eager(mesh, args)

    def lower(self, *args):
        """The traced and partitioned program, as ``pjit(...).lower``."""
        mesh = current_mesh(self.mesh, self.name)
        if id(mesh) not in self._lowered:
            def region(*a):
                return self._emit(mesh, a)

            jitted = Pjit(region, self.in_specs, self.out_specs, mesh, None, ())
            jitted.name = self.name
            self._lowered[id(mesh)] = jitted
        return self._lowered[id(mesh)].lower(*args)

    # -- the arguments ------------------------------------------------------------------
    def _inputs(self, mesh, args):
        """Flat leaves, tree, per tensor leaf: (tensor, spec), and the tensor leaves'
        paths."""
        leaves, treedef = _tree.flatten(args)
        specs = _tree.arg_specs(self.in_specs, args, self.name)
        paths = _tree.leaf_paths(args, "args")
        tensors, tensor_paths = [], []
        for x, (spath, spec), apath in zip(leaves, specs, paths):
            if not isinstance(x, torch.Tensor):
                continue
            spec = P() if spec is None else spec
            check_spec(spec, x.shape, mesh, f"{spath} (for {apath})")
            tensors.append((x, spec))
            tensor_paths.append(apath)
        return leaves, treedef, tensors, tensor_paths

    def _flat_body(self, leaves, treedef, out_info):
        def flat_body(*local_tensors):
            it = iter(local_tensors)
            full = [next(it) if isinstance(x, torch.Tensor) else x for x in leaves]
            out = self.fn(*_tree.unflatten(treedef, full))
            out_leaves, out_treedef = _tree.flatten(out)
            out_info["treedef"] = out_treedef
            return out_leaves

        return flat_body

    def _describe(self, mesh, out_info):
        """The layouts of the outputs from their local blocks and the out_specs."""
        sizes = dict(zip(mesh.axis_names, mesh.shape))

        def describe(outs):
            out_tree = _tree.unflatten(out_info["treedef"], outs)
            matched = _tree.broadcast_prefix(self.out_specs, out_tree, f"{self.name} out_specs")
            layouts = []
            for o, (spath, spec), opath in zip(outs, matched, _tree.leaf_paths(out_tree, "output")):
                spec = P() if spec is None else spec
                full = tuple(s * math.prod(sizes.get(a, 1) for a in axes_of_dim(spec, d))
                             for d, s in enumerate(o.shape))
                check_spec(spec, full, mesh, f"{spath} (for {opath})")
                layouts.append((to_placements(spec, mesh), frozenset(spec.axes()), full,
                                f"{spath} (for {opath})"))
            return layouts

        return describe

    # -- inside a global trace: one region of the program -----------------------------------
    def _emit(self, mesh: Mesh, args: tuple):
        leaves, treedef, tensors, _ = self._inputs(mesh, args)
        out_info: dict = {}
        boundary = _region.Boundary(
            in_placements=[to_placements(s, mesh) for _, s in tensors],
            in_axes=[frozenset(s.axes()) for _, s in tensors],
            describe=self._describe(mesh, out_info),
        )
        metas = [(local_shape(x.shape, s, mesh), x.dtype) for x, s in tensors]
        region = _region.trace_region(self._flat_body(leaves, treedef, out_info), metas,
                                      boundary, mesh, self.name, self.check_vma)
        inputs = [x for x, _ in tensors] + list(region.captured)
        if region.n_draws:
            inputs.append(RNG_STATE_OP(region.n_draws, region.device))
        outs = _region.call(region, inputs)
        return _tree.unflatten(out_info["treedef"], outs)

    # -- eagerly: op by op on this rank's shards ------------------------------------------
    def _eager(self, mesh: Mesh, args: tuple):
        """The body op by op, between two cross-rank agreements (sharded/sync.py): on
        the inputs before it (a rank given another shape fails here, not in gloo) and
        on the outputs' global shapes after it (a rank-dependent shape fails here, not
        when the result is gathered); a failure in the body reaches every rank."""
        try:
            leaves, treedef, tensors, paths = self._inputs(mesh, args)
            lines = [f"input {i}: {str(x.dtype).replace('torch.', '')}{list(x.shape)} {s!r}"
                     + (f" from {tuple(x.placements)}" if isinstance(x, DTensor) else "")
                     for i, (x, s) in enumerate(tensors)]
            # a plain tensor is one global value (NOTE [Per-rank data] in sharded/data.py)
            plain = [(p, x) for p, (x, _) in zip(paths, tensors)
                     if not isinstance(x, DTensor) and not _torch.is_functorch_wrapped(x)]
            values = tuple(zip([p for p, _ in plain], value_digests([x for _, x in plain])))
            outcome: sync.Outcome | Exception = sync.Outcome(sync.token(*lines), lambda: lines,
                                                             values=values)
        except Exception as e:  # noqa: BLE001 - every rank must hear about it
            outcome = e
        sync.agree(mesh, self.name, outcome)
        result, out_lines = sync.run_guarded(self.name, self._eager_run, mesh, leaves, treedef,
                                             tensors, mesh=mesh)
        sync.agree(mesh, self.name, sync.Outcome(sync.token(*out_lines), lambda: out_lines))
        return result

    def _eager_run(self, mesh: Mesh, leaves, treedef, tensors):
        dm = mesh.device_mesh
        local = []
        for k, (x, spec) in enumerate(tensors):
            if _torch.is_functorch_wrapped(x):
                raise TypeError(
                    f"{self.name} was called inside a torch.func transform (grad, vmap, "
                    f"...); an eager shard_map call is not differentiable from outside. Put "
                    f"the transform inside a function that pjit traces: "
                    f"pjit(torch.func.grad(loss), ...)."
                )
            check_on_mesh(x, mesh, f"tensor input {k}", self.name, "shard_map")
            local.append(local_input(x, to_placements(spec, mesh), mesh).detach())
        out_info: dict = {}
        describe = self._describe(mesh, out_info)
        ctx = _manual.ManualContext(mesh, self.check_vma, self.name, eager=True)
        with _manual.manual_region(ctx):
            for t, (_, spec) in zip(local, tensors):
                _manual.set_vma(t, spec.axes())
            outs = [_region._as_tensor(o, self.name, i)
                    for i, o in enumerate(self._flat_body(leaves, treedef, out_info)(*local))]
            layouts = describe(outs)
            _region.finish_outputs(outs, layouts, mesh, self.check_vma, cast=False)
        result = [
            DTensor.from_local(o.detach().contiguous(), dm, placements, run_check=False,
                               shape=torch.Size(shape), stride=contiguous_strides(shape))
            for o, (placements, _, shape, _) in zip(outs, layouts)
        ]
        out_lines = [f"output {path}: {str(o.dtype).replace('torch.', '')}{list(shape)} "
                     f"{tuple(placements)}" for o, (placements, _, shape, path) in zip(outs, layouts)]
        return _tree.unflatten(out_info["treedef"], result), out_lines

