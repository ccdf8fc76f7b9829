"""shard_map: per-rank code over named mesh axes, the manual counterpart of pjit.

``fn`` sees this rank's shards (laid out by ``in_specs``) and communicates through
``sharded.collectives``. Its outputs are this rank's blocks of the results, laid out by
``out_specs``; with ``check_vma`` an output that still varies over an axis its spec
does not name is rejected at trace time.

Eagerly, a shard_map call is compiled like a pjit call (traced once per signature,
cached). Inside a pjit-traced function it becomes one op of the global program that
the partitioner runs on this rank's shards (NOTE [shard_map in a traced program] in
sharded/_manual.py), so it composes with torch.func.grad and with automatically
partitioned code around it.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch

from sharded import _manual, _torch, _tree
from sharded.mesh import Mesh, current_mesh
from sharded.spec import P, axes_of_dim, check_spec, local_shape, to_placements
from transforms._trace import in_global_trace
from transforms.pjit import Pjit


def shard_map(fn: Callable | None = None, /, *, mesh: Mesh | None = None, in_specs,
              out_specs, check_vma: bool = True):
    """Map ``fn`` over the shards of its arguments (see the module docstring).

    - ``in_specs``: a pytree prefix of the positional args (P or None leaves).
    - ``out_specs``: a pytree prefix of the outputs. An axis an out_spec does not
      name means the output is the same on every rank along it.
    """
    if fn is None:
        return functools.partial(shard_map, mesh=mesh, in_specs=in_specs,
                                 out_specs=out_specs, check_vma=check_vma)
    return ShardMap(fn, mesh, in_specs, out_specs, check_vma)


class ShardMap:
    def __init__(self, fn, mesh, in_specs, out_specs, check_vma):
        self.fn = fn
        self.mesh = mesh
        self.in_specs = in_specs
        self.out_specs = out_specs
        self.check_vma = check_vma
        self.name = f"shard_map({getattr(fn, '__name__', type(fn).__name__)})"
        self._compiled: dict[int, Pjit] = {}
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
        return self._jitted(mesh)(*args)

    def lower(self, *args):
        """The traced and partitioned program, as ``pjit(...).lower``."""
        return self._jitted(current_mesh(self.mesh, self.name)).lower(*args)

    def _jitted(self, mesh) -> Pjit:
        """Eager calls run as a pjit of the region (traced once per signature)."""
        if id(mesh) not in self._compiled:
            def region(*args):
                return self._emit(mesh, args)

            jitted = Pjit(region, self.in_specs, self.out_specs, mesh, None, ())
            jitted.name = self.name
            self._compiled[id(mesh)] = jitted
        return self._compiled[id(mesh)]

    # -- inside a global trace: one op for the whole region -----------------------------
    def _emit(self, mesh: Mesh, args: tuple):
        leaves, treedef = _tree.flatten(args)
        specs = _tree.arg_specs(self.in_specs, args, self.name)
        paths = _tree.leaf_paths(args, "args")
        tensors, in_pl, in_vma, local_metas = [], [], [], []
        for x, (spath, spec), apath in zip(leaves, specs, paths):
            if not isinstance(x, torch.Tensor):
                continue
            spec = P() if spec is None else spec
            check_spec(spec, x.shape, mesh, f"{spath} (for {apath})")
            tensors.append(x)
            in_pl.append(to_placements(spec, mesh))
            in_vma.append(frozenset(spec.axes()))
            local_metas.append((local_shape(x.shape, spec, mesh), x.dtype, x.device))

        def flat_body(*local_tensors):
            it = iter(local_tensors)
            full = [next(it) if isinstance(x, torch.Tensor) else x for x in leaves]
            out = self.fn(*_tree.unflatten(treedef, full))
            out_leaves, out_treedef = _tree.flatten(out)
            for i, o in enumerate(out_leaves):
                if not isinstance(o, torch.Tensor):
                    raise TypeError(
                        f"{self.name}: output leaf {i} is {type(o).__name__}; shard_map "
                        f"outputs must be tensors."
                    )
            flat_body.out_treedef = out_treedef
            return out_leaves

        body = _manual.ManualBody(
            fn=flat_body, mesh=mesh, name=self.name, check_vma=self.check_vma,
            in_placements=in_pl, in_vma=in_vma, out_placements=[], out_allowed=[],
            out_paths=[], out_shapes=[], out_dtypes=[],
        )
        self._infer_outputs(body, local_metas)
        body_id = _manual.register_body(body)
        outs = _ShardMapFn.apply(body_id, *tensors)
        return _tree.unflatten(flat_body.out_treedef, list(outs))  # type: ignore[attr-defined]

    def _infer_outputs(self, body, local_metas):
        """Run the body once on fake local shards (outside the trace) for its output
        shapes, layouts and varying axes; errors surface here, at trace time."""

        sizes = dict(zip(body.mesh.axis_names, body.mesh.shape))

        def describe(outs):
            out_tree = _tree.unflatten(body.fn.out_treedef, outs)
            matched = _tree.broadcast_prefix(self.out_specs, out_tree, f"{self.name} out_specs")
            for o, (spath, spec), opath in zip(outs, matched, _tree.leaf_paths(out_tree, "output")):
                spec = P() if spec is None else spec
                full = tuple(s * math.prod(sizes.get(a, 1) for a in axes_of_dim(spec, d))
                             for d, s in enumerate(o.shape))
                check_spec(spec, full, body.mesh, f"{spath} (for {opath})")
                body.out_placements.append(to_placements(spec, body.mesh))
                body.out_allowed.append(frozenset(spec.axes()))
                body.out_paths.append(f"{spath} (for {opath})")
                body.out_shapes.append(full)
                body.out_dtypes.append(o.dtype)

        with _torch.suspend_dispatch_modes(), _torch.new_fake_mode():
            fakes = [torch.empty(s, dtype=d, device=dev) for s, d, dev in local_metas]
            _manual.run_body(body, fakes, describe=describe)


class _ShardMapFn(torch.autograd.Function):
    """The region as one differentiable op of the global program."""

    @staticmethod
    def forward(body_id, *inputs):
        return tuple(_manual.SHARD_MAP_OP(list(inputs), body_id))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.body_id = inputs[0]
        ctx.save_for_backward(*inputs[1:])

    @staticmethod
    def backward(ctx, *cts):
        if _torch.functorch_level() > 1:
            raise NotImplementedError(
                f"{_manual.get_body(ctx.body_id).name}: only first-order gradients go "
                f"through a shard_map (torch.func.grad of grad, or vmap around grad, is "
                f"not supported)."
            )
        inputs = ctx.saved_tensors
        body = _manual.get_body(ctx.body_id)
        if not inputs:
            return (None,)
        cts = [torch.zeros(s, dtype=d, device=inputs[0].device) if ct is None else ct
               for ct, s, d in zip(cts, body.out_shapes, body.out_dtypes)]
        with torch.no_grad():  # first-order only: the vjp op has no autograd of its own
            grads = _manual.SHARD_MAP_VJP_OP(list(inputs), cts, ctx.body_id)
        return (None, *[g if _manual.differentiable(x) else None for g, x in zip(grads, inputs)])
