"""Placing pytrees on a mesh and reading them back: shard, gather, spec_of,
with_sharding_constraint, visualize_sharding."""

from __future__ import annotations

import ast
import functools
import itertools

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from sharded import _tree, sync
from sharded.mesh import Mesh, current_mesh, slice_of
from sharded.spec import P, block, check_spec, from_placements, local_slice, to_placements

__all__ = ["shard", "gather", "spec_of", "with_sharding_constraint", "visualize_sharding"]


def shard(tree, specs, mesh: Mesh | None = None):
    """Lay out every tensor of ``tree`` on ``mesh`` as ``specs`` says (like
    ``jax.device_put``); returns the same pytree with DTensor leaves.

    ``specs`` is a pytree prefix of ``tree`` (a single ``P`` covers everything).
    Plain tensors are taken as the same global value on every rank and sliced
    locally (no communication, and their values are not compared across ranks: give
    every rank the same values, e.g. from the same seed; for data that each rank
    loads on its own use ``sharded.from_local_data``); DTensors are redistributed if
    their layout differs. Non-tensor leaves are returned unchanged.
    """
    mesh = current_mesh(mesh, "shard")
    leaves, treedef = _tree.flatten(tree)
    paths = _tree.leaf_paths(tree, "tree")
    matched = _tree.broadcast_prefix(specs, tree, "shard specs")
    out = []
    for leaf, lpath, (spath, spec) in zip(leaves, paths, matched):
        if not isinstance(leaf, torch.Tensor):
            out.append(leaf)
            continue
        spec = P() if spec is None else spec
        check_spec(spec, leaf.shape, mesh, f"shard {spath} (for {lpath})")
        out.append(place(leaf, to_placements(spec, mesh), mesh))
    return _tree.unflatten(treedef, out)


def place(x: torch.Tensor, placements, mesh: Mesh) -> DTensor:
    """``x`` as a DTensor with ``placements`` on ``mesh`` (redistributing a DTensor,
    slicing a plain tensor locally)."""
    if isinstance(x, DTensor):
        if x.device_mesh != mesh.device_mesh:
            raise ValueError(
                f"the DTensor lives on {x.device_mesh}, not on {mesh}; gather it first "
                f"(sharded.gather) and shard it onto the new mesh."
            )
        if tuple(x.placements) != tuple(placements):
            x = x.redistribute(mesh.device_mesh, placements)
        return x
    local = local_slice(x.detach(), placements, mesh)
    return DTensor.from_local(
        local, mesh.device_mesh, placements, run_check=False, shape=x.shape, stride=x.stride()
    )


def gather(tree):
    """Every DTensor of ``tree`` as a full plain tensor on every rank (a pipeline
    stage's, held by its stage's ranks only, is sent from them: NOTE [Stage slices] in
    sharded/mesh.py)."""
    leaves, treedef = _tree.flatten(tree)
    for dm in {id(x.device_mesh): x.device_mesh for x in leaves if isinstance(x, DTensor)}.values():
        found = slice_of(dm)
        (found[0] if found is not None else Mesh.from_device_mesh(dm)).require_ranks("gather")
    with sync.peer_failures("gather"):
        full = [_full(x) if isinstance(x, DTensor) else x for x in leaves]
    return _tree.unflatten(treedef, full)


def _full(x: DTensor) -> torch.Tensor:
    found = slice_of(x.device_mesh)
    if found is None:
        return x.full_tensor()
    mesh, axis, coord = found
    if mesh.coordinate()[mesh.axis_names.index(axis)] == coord:
        t = x.full_tensor().contiguous()
    else:
        t = torch.empty(x.shape, dtype=x.dtype, device=mesh.device)
    dist.broadcast(t, group=mesh.device_mesh.get_group(axis), group_src=coord)
    return t


def spec_of(x: DTensor) -> P:
    """The PartitionSpec of a DTensor (error if it holds a pending reduction)."""
    if not isinstance(x, DTensor):
        raise TypeError(f"spec_of expects a DTensor; got {type(x).__name__}.")
    mesh = Mesh.from_device_mesh(x.device_mesh)
    return from_placements(x.placements, mesh, x.ndim)


# ---------------------------------------------------------------------------
# with_sharding_constraint: an identity op that the partitioner honours
# ---------------------------------------------------------------------------

# NOTE [The constraint's spec travels as text]
# The op carries its spec as the text of its entries (``"('dp', None)"``), not as an
# id into a process-wide table: a table grows with every new spec for the life of the
# process, needs a lock, and gives the same spec different ids on different ranks
# (which would make equal programs look different to the cross-rank agreement).


def spec_text(spec: P) -> str:
    """The op argument for ``spec`` (read back by ``constraint_spec``)."""
    return repr(tuple(spec))


@functools.lru_cache(maxsize=256)
def constraint_spec(text: str) -> P:
    """The P that ``spec_text`` wrote."""
    return P(*ast.literal_eval(text))


@torch.library.custom_op("sharded::sharding_constraint", mutates_args=())
def _constraint(x: torch.Tensor, spec: str) -> torch.Tensor:
    return x.clone()


@_constraint.register_fake
def _(x, spec):
    return torch.empty_like(x)


CONSTRAINT_OP = torch.ops.sharded.sharding_constraint.default


class _Constraint(torch.autograd.Function):
    """Differentiable under torch.func: the cotangent gets the same layout (JAX's
    transpose of a sharding constraint)."""

    @staticmethod
    def forward(x, spec):
        return CONSTRAINT_OP(x, spec)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.spec = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return _Constraint.apply(grad, ctx.spec), None


def with_sharding_constraint(x: torch.Tensor, spec: P, mesh: Mesh | None = None):
    """Force the layout of ``x``.

    Inside a function traced by ``pjit``, the partitioner redistributes ``x`` to
    ``spec`` at this point of the program. On an eager DTensor it redistributes now.
    """
    if not isinstance(spec, P):
        raise TypeError(f"with_sharding_constraint expects a P; got {spec!r}.")
    if isinstance(x, DTensor):
        mesh = mesh or Mesh.from_device_mesh(x.device_mesh)
        check_spec(spec, x.shape, mesh, "with_sharding_constraint spec")
        return x.redistribute(mesh.device_mesh, to_placements(spec, mesh))
    return _Constraint.apply(x, spec_text(spec))


# ---------------------------------------------------------------------------
# visualize_sharding
# ---------------------------------------------------------------------------


def visualize_sharding(x: DTensor, *, file=None) -> str:
    """Print (on rank 0) and return which rank holds which block of ``x``."""
    mesh = Mesh.from_device_mesh(x.device_mesh)
    spec = spec_of(x)
    lines = [f"{tuple(x.shape)} {x.dtype} as {spec!r} on {mesh!r}:"]
    ranks = x.device_mesh.mesh
    placements = to_placements(spec, mesh)
    for coord in itertools.product(*[range(s) for s in mesh.shape]):
        rank = int(ranks[coord])
        sizes, starts = block(x.shape, placements, mesh, coord)
        where = ", ".join(f"{n}={c}" for n, c in zip(mesh.axis_names, coord))
        spans = ", ".join(f"{lo}:{lo + size}" for lo, size in zip(starts, sizes))
        lines.append(f"  rank {rank} ({where}): [{spans}]")
    text = "\n".join(lines)
    if torch.distributed.get_rank() == 0:
        print(text, file=file)
    return text
