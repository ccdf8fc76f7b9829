"""Tensor-parallel plans: torch's parallelize_module styles, for programs that pjit
traces.

A plan maps module paths (fnmatch patterns per path atom, as ``parallelize_module``
takes them) to styles: the project's builders (``colwise``, ``rowwise``,
``sequence_parallel``, ``prepare_input``, ``prepare_output``), torch's own
ParallelStyle objects (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``,
``PrepareModuleInput``, ``PrepareModuleOutput``, ``PrepareModuleInputOutput``), or
transformers' plan strings (``"colwise"``, ``"rowwise"``, ...: a model's
``config.base_model_tp_plan`` as it is; NOTE [transformers' plan strings]).

- ``specs_from_plan(module_or_params, plan, mesh, *, axis="tp")``: the spec of every
  parameter (``P()`` where the plan says nothing).
- ``parallelize(module, plan, mesh, *, axis="tp")``: the same specs, and the styles'
  activation layouts applied as sharding constraints whenever pjit traces the module
  (module hooks that do nothing outside pjit's trace).

# NOTE [Styles are layouts on one mesh axis]
A torch style describes layouts on a 1-D TP mesh: ``Shard(1)`` is "dim 1 split over
the TP ranks". Here the plan's ``axis`` is that mesh axis, and a style's layouts
constrain only it: on a ("dp", "tp") mesh the batch keeps its "dp" split through
every constraint, so DP x TP is the plan plus a batch spec. Layouts may be given as
placements (``Shard(1)``, ``Replicate()``) or as a ``P`` over the plan's axis
(``P(None, "tp")`` is ``Shard(1)``, ``P()`` is ``Replicate()``).
"""

from __future__ import annotations

import difflib
import fnmatch
from dataclasses import dataclass, field
from typing import Any

import optree
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from sharded import _manual, _registry, _torch
from sharded._trace_state import in_global_trace
from sharded.mesh import Mesh, current_mesh
from sharded.spec import P, check_spec

__all__ = [
    "Style", "colwise", "rowwise", "sequence_parallel", "prepare_input", "prepare_output",
    "specs_from_plan", "parallelize",
]


# ---------------------------------------------------------------------------------------
# API: the style builders
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Style:
    """A tensor-parallel style, as the builders below make it. The fields follow the
    arguments of torch's styles; a layout is a ``Placement``, a ``P`` over the plan's
    axis, or None (the style's default)."""

    kind: str
    input_layouts: Any = None
    output_layouts: Any = None
    desired_input_layouts: Any = None
    desired_output_layouts: Any = None
    input_kwarg_layouts: Any = None
    desired_input_kwarg_layouts: Any = None
    sequence_dim: int = 1
    embedding: bool = False

    def __repr__(self):
        args = []
        for name in ("input_layouts", "output_layouts", "desired_input_layouts",
                     "desired_output_layouts", "input_kwarg_layouts",
                     "desired_input_kwarg_layouts"):
            v = getattr(self, name)
            if v is not None:
                args.append(f"{name}={v!r}")
        if self.kind == "sequence_parallel" and self.sequence_dim != 1:
            args.append(f"sequence_dim={self.sequence_dim}")
        if self.embedding:
            args.append("embedding=True")
        return f"{self.kind}({', '.join(args)})"


def colwise(*, input_layouts=None, output_layouts=None, embedding: bool = False) -> Style:
    """Column-wise parallel (torch's ColwiseParallel). nn.Linear: weight [out, in]
    split on dim 0, bias split; nn.Embedding: weight split on dim 1. The input is
    laid out as ``input_layouts`` (default replicated) and used replicated; the output
    is split on its last dim, then laid out as ``output_layouts`` (default: left so).

    ``embedding=True`` says that a plain params dict's 2-D tensor is an embedding
    table (a module's type says it already)."""
    return Style("colwise", input_layouts=input_layouts, output_layouts=output_layouts,
                 embedding=embedding)


def rowwise(*, input_layouts=None, output_layouts=None, embedding: bool = False) -> Style:
    """Row-wise parallel (torch's RowwiseParallel). nn.Linear: weight [out, in] split
    on dim 1, bias replicated, input used split on its last dim; nn.Embedding: weight
    split on dim 0, input (the ids) used replicated. The output is a pending sum,
    reduced to ``output_layouts`` (default ``Replicate()``: an all-reduce;
    ``Shard(1)``: a reduce-scatter over the sequence).

    ``embedding=True`` says that a plain params dict's 2-D tensor is an embedding
    table (a module's type says it already)."""
    return Style("rowwise", input_layouts=input_layouts, output_layouts=output_layouts,
                 embedding=embedding)


def sequence_parallel(*, sequence_dim: int = 1) -> Style:
    """Sequence parallel (torch's SequenceParallel), for norms and dropout: the
    module's input and output are split on ``sequence_dim``; its parameters are
    replicated."""
    if not isinstance(sequence_dim, int):
        raise TypeError(f"sequence_parallel: sequence_dim must be an int; got {sequence_dim!r}.")
    return Style("sequence_parallel", sequence_dim=sequence_dim)


def prepare_input(*, input_layouts=None, desired_input_layouts=None,
                  input_kwarg_layouts: dict | None = None,
                  desired_input_kwarg_layouts: dict | None = None) -> Style:
    """Lay out a module's inputs (torch's PrepareModuleInput): positional input ``i``
    is laid out as ``input_layouts[i]``, then redistributed to
    ``desired_input_layouts[i]`` (None entries: leave that input alone); keyword
    inputs likewise by name. A single layout stands for a 1-tuple."""
    ins, desired = _as_tuple(input_layouts), _as_tuple(desired_input_layouts)
    if ins is not None and (desired is None or len(ins) != len(desired)):
        raise ValueError(
            f"prepare_input: input_layouts {ins!r} and desired_input_layouts {desired!r} "
            f"need one entry each per positional input (None to leave an input alone)."
        )
    kw, dkw = dict(input_kwarg_layouts or {}), dict(desired_input_kwarg_layouts or {})
    if set(dkw) - set(kw):
        raise ValueError(
            f"prepare_input: desired_input_kwarg_layouts names {sorted(set(dkw) - set(kw))}, "
            f"which input_kwarg_layouts does not; give each keyword input a layout in both."
        )
    return Style("prepare_input", input_layouts=ins, desired_input_layouts=desired,
                 input_kwarg_layouts=_frozen(kw), desired_input_kwarg_layouts=_frozen(dkw))


def prepare_output(*, output_layouts, desired_output_layouts) -> Style:
    """Lay out a module's outputs (torch's PrepareModuleOutput): output ``i`` is laid
    out as ``output_layouts[i]``, then redistributed to ``desired_output_layouts[i]``
    (None entries: leave that output alone). A single layout stands for a 1-tuple."""
    outs, desired = _as_tuple(output_layouts), _as_tuple(desired_output_layouts)
    if outs is None or desired is None or len(outs) != len(desired):
        raise ValueError(
            f"prepare_output: output_layouts {outs!r} and desired_output_layouts "
            f"{desired!r} need one entry each per output (None to leave an output alone)."
        )
    return Style("prepare_output", output_layouts=outs, desired_output_layouts=desired)


def _as_tuple(layouts):
    if layouts is None:
        return None
    if isinstance(layouts, (Placement, P)):
        return (layouts,)
    return tuple(layouts)


def _frozen(d: dict):
    return tuple(sorted(d.items())) if d else None


# ---------------------------------------------------------------------------------------
# API: specs_from_plan and parallelize
# ---------------------------------------------------------------------------------------

def specs_from_plan(module_or_params, plan, mesh: Mesh | None = None, *, axis: str = "tp"):
    """The spec of every parameter under ``plan`` (``P()`` where it says nothing).

    - An ``nn.Module``: plan keys are module paths with fnmatch patterns per path atom
      (``"blocks.*.attn.w[qkv]"``), as torch's ``parallelize_module`` takes them;
      returns ``{param path: P}`` in ``named_parameters()`` order, the keys of
      ``dict(module.named_parameters())``.
    - A params pytree (e.g. a dict): keys match its key paths (``"blocks.*.mlp.up"``
      covers every tensor below it, ``"blocks.*.mlp.up.weight"`` that tensor); a 2-D
      tensor is taken as nn.Linear's [out, in] weight (or an embedding table with
      ``embedding=True``), a 1-D one as its bias. Returns the same pytree with ``P``
      leaves.

    ``plan`` may also be a single style (applied to the root). ``mesh`` defaults to
    the one of an enclosing ``with mesh:``. A key that matches nothing, a style that does not fit its module and two keys that give one
    parameter different specs are errors.
    """
    mesh = _check_mesh(mesh, axis, "specs_from_plan")
    entries = _plan_entries(plan, "specs_from_plan")
    if isinstance(module_or_params, nn.Module):
        return _module_specs(module_or_params, entries, mesh, axis, "specs_from_plan")[0]
    return _params_specs(module_or_params, entries, mesh, axis)


def parallelize(module: nn.Module, plan, mesh: Mesh | None = None, *, axis: str = "tp") -> dict:
    """``specs_from_plan(module, plan, mesh, axis=axis)``, and the plan's activation
    layouts made part of every program pjit traces through ``module``.

    Each matched module gets forward (pre-)hooks that, while pjit traces (and only
    then), lay out its inputs and outputs as its style says, as sharding constraints
    over ``axis`` (other mesh axes keep their layouts). Outside pjit's trace the hooks
    do nothing: the module computes the single-device program. Modules that update
    buffers in place (BatchNorm's running stats in training mode) fail the trace with
    an error that names them. Calling ``parallelize`` again replaces the hooks.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"parallelize expects an nn.Module; got {type(module).__name__}. For a params "
            f"pytree use specs_from_plan (a functional program places its own "
            f"with_sharding_constraint calls)."
        )
    mesh = _check_mesh(mesh, axis, "parallelize")
    entries = _plan_entries(plan, "parallelize")
    specs, bound = _module_specs(module, entries, mesh, axis, "parallelize")
    _remove_hooks(module)
    handles = []
    for path, sub in module.named_modules():
        styles = bound.get(id(sub), [])
        if styles:
            handles.append(sub.register_forward_pre_hook(_InputHook(styles), with_kwargs=True))
            handles.append(sub.register_forward_hook(_OutputHook(styles)))
        if any(True for _ in sub.named_buffers(recurse=False)):
            check = _BufferCheck(path or "<root>")
            handles.append(sub.register_forward_pre_hook(check.before, prepend=True))
            handles.append(sub.register_forward_hook(check.after, always_call=True))
    module.__dict__[_HANDLES] = handles
    return specs


_HANDLES = "_sharded_plan_hooks"


def _remove_hooks(module: nn.Module) -> None:
    for h in module.__dict__.pop(_HANDLES, []):
        h.remove()


# ---------------------------------------------------------------------------------------
# Checks and plan entries
# ---------------------------------------------------------------------------------------

def _check_mesh(mesh, axis, api) -> Mesh:
    if mesh is None:
        mesh = current_mesh(None, api)
    if not isinstance(mesh, Mesh):
        from torch.distributed.device_mesh import DeviceMesh

        if isinstance(mesh, DeviceMesh):
            mesh = Mesh.from_device_mesh(mesh)
        else:
            raise TypeError(f"{api} expects a sharded.Mesh as mesh; got {type(mesh).__name__}.")
    if axis not in mesh.axis_names:
        raise ValueError(
            f"{api}: axis={axis!r} is not an axis of {mesh!r}; pass the tensor-parallel "
            f"axis, e.g. axis={mesh.axis_names[-1]!r}."
        )
    return mesh


@dataclass
class _Entry:
    key: str
    atoms: tuple
    styles: list          # [Style]
    shown: str            # the plan value as the user wrote it
    refused: str | None = None   # a transformers plan string sharded does not take: why
    named: bool = False          # a transformers plan string (its key may name a parameter)


def _plan_entries(plan, api) -> list[_Entry]:
    if isinstance(plan, (Style, ParallelStyle, str)):
        plan = {"": plan}
    if plan is None:
        raise TypeError(
            f"{api}: plan is None. A transformers config without a tensor-parallel plan "
            f"(GPT-2's config.base_model_tp_plan is None) has none to give; write the plan "
            f"as a dict from module paths to styles, e.g. {{'layers.*.mlp.up_proj': "
            f"'colwise'}}, or train the model data parallel."
        )
    if not isinstance(plan, dict):
        raise TypeError(
            f"{api}: plan must be a dict from module paths to styles (or one style); got "
            f"{type(plan).__name__}."
        )
    out = []
    for key, value in plan.items():
        if not isinstance(key, str):
            raise TypeError(f"{api}: plan key {key!r} is not a string (a module path).")
        where = f"{api}: plan[{key!r}]"
        refused = None
        if isinstance(value, str):
            styles, refused = _hf_styles(value, where)
        else:
            styles = _styles_of(value, where)
        out.append(_Entry(key, tuple(key.split(".")) if key else (), styles, repr(value),
                          refused, named=isinstance(value, str)))
    return out


def _styles_of(value, where) -> list[Style]:
    """The project's Style objects for a plan value (torch's styles converted)."""
    if isinstance(value, Style):
        return [value]
    if isinstance(value, PrepareModuleInputOutput):
        return (_styles_of(value.prepare_module_input, where)
                + _styles_of(value.prepare_module_output, where))
    if isinstance(value, ColwiseParallel):
        return [colwise(input_layouts=value.input_layouts[0],
                        output_layouts=value.output_layouts[0])]
    if isinstance(value, RowwiseParallel):
        return [rowwise(input_layouts=value.input_layouts[0],
                        output_layouts=value.output_layouts[0])]
    if isinstance(value, SequenceParallel):
        return [sequence_parallel(sequence_dim=value.sequence_sharding[0].dim)]
    if isinstance(value, PrepareModuleInput):
        return [prepare_input(
            input_layouts=value.input_layouts,
            desired_input_layouts=value.desired_input_layouts,
            input_kwarg_layouts=value.input_kwarg_layouts,
            desired_input_kwarg_layouts=value.desired_input_kwarg_layouts,
        )]
    if isinstance(value, PrepareModuleOutput):
        return [prepare_output(output_layouts=value.output_layouts,
                               desired_output_layouts=value.desired_output_layouts)]
    raise TypeError(
        f"{where} is {value!r}; expected a style: sharded.plans.colwise(), rowwise(), "
        f"sequence_parallel(), prepare_input(...), prepare_output(...), torch's "
        f"ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput, "
        f"PrepareModuleOutput, PrepareModuleInputOutput, or one of transformers' plan "
        f"strings ('colwise', 'rowwise', ...: docs/plans.md)."
    )


# ---------------------------------------------------------------------------------------
# transformers' plan strings
# ---------------------------------------------------------------------------------------

# NOTE [transformers' plan strings]
# A transformers config carries its model's tensor-parallel plan as strings
# (``config.base_model_tp_plan``: {"layers.*.self_attn.q_proj": "colwise", ...}) that
# name the styles transformers registers (``ALL_PARALLEL_STYLES`` in
# transformers.distributed.tensor_parallel; older releases had the ``local_*``,
# ``gather`` and ``isolated`` names). Each name maps to the style here that lays out
# the same parameters and activations, or is refused with its reason and what to
# write instead. transformers runs some styles on each rank's local shards and adds
# the collectives that make the result right by hand (the gradient all-reduce of a
# replicated per-head norm, the sum of partial outputs); a pjit program is global, so
# those sums are part of the program whatever the layouts, and such styles map to no
# style at all: the module's parameters are replicated. Refused are the styles whose
# layout no ``P`` expresses (a fused gate/up weight split part by part: DTensor's
# _StridedShard) and the expert-parallel ones (experts run on local weights with
# their own all-to-alls), which have no counterpart here.

_PACKED = ("splits a fused weight (gate and up projections packed along one dim) part "
           "by part (DTensor's _StridedShard), a layout no P expresses",
           "unfuse the projections and use 'colwise'/'rowwise' on them, or leave the "
           "module out of the plan and give its weight a spec by hand")
_EXPERTS = ("runs mixture-of-experts weights on each rank's local shards with its own "
            "collectives; sharded.plans has no expert-parallel style",
            "leave the experts out of the plan (replicated), or give their weights specs "
            "by hand (e.g. P('tp') on the expert dim)")
_LOCAL = ("runs the module's forward on its local parameter shards, which a pjit "
          "program (global values) does not have",
          "leave the module out of the plan and give its parameters specs by hand")

# name -> the styles it maps to (a function: Styles are built per call), or
# (why it is refused, what to use instead)
_HF_PLAN_STRINGS: dict = {
    "colwise": lambda: [colwise()],
    "rowwise": lambda: [rowwise()],
    "colwise_rep": lambda: [colwise(output_layouts=Replicate())],
    "colwise_gather_output": lambda: [colwise(output_layouts=Replicate())],
    "rowwise_rep": lambda: [rowwise(input_layouts=Replicate())],
    "rowwise_split_input": lambda: [rowwise(input_layouts=Replicate())],
    "embedding_rowwise": lambda: [rowwise(input_layouts=Replicate(), embedding=True)],
    "embedding_colwise": lambda: [colwise(output_layouts=Replicate(), embedding=True)],
    "sequence_parallel": lambda: [sequence_parallel()],
    "local_colwise": lambda: [colwise()],
    "local_rowwise": lambda: [rowwise()],
    "replicate": lambda: [],
    "replicated_with_grad_allreduce": lambda: [],
    "mla_kv_a_proj": lambda: [],
    "all_reduce": lambda: [],
    "gather": lambda: [],
    "packed_colwise": _PACKED,
    "packed_rowwise": _PACKED,
    "local_packed_rowwise": _PACKED,
    "moe_tp_experts": _EXPERTS,
    "moe_identity_expert": _EXPERTS,
    "grouped_gemm": _EXPERTS,
    "ep_router": _EXPERTS,
    "ep_dispatch_experts": _EXPERTS,
    "local": _EXPERTS,
    "isolated": _EXPERTS,
    "local_params": _LOCAL,
}


def _hf_styles(name: str, where: str) -> tuple[list[Style], str | None]:
    """(styles, None) for a transformers plan string that maps, ([], why) for one that
    is refused (raised once it is known which module it is on)."""
    entry = _HF_PLAN_STRINGS.get(name)
    if entry is None:
        close = difflib.get_close_matches(name, list(_HF_PLAN_STRINGS), n=3, cutoff=0.5)
        raise ValueError(
            f"{where} is {name!r}, which is not a transformers plan string that "
            f"sharded.plans knows{f' (close: {close})' if close else ''}. Known: "
            f"{sorted(_HF_PLAN_STRINGS)}; or give a style object (colwise(), rowwise(), "
            f"torch's ColwiseParallel, ...)."
        )
    if isinstance(entry, tuple):
        why, instead = entry
        return [], f"transformers' {name!r} style {why}; {instead}."
    return entry(), None


def _matches(atoms: tuple, path_atoms: tuple) -> bool:
    return len(atoms) == len(path_atoms) and all(
        fnmatch.fnmatchcase(p, a) for a, p in zip(atoms, path_atoms))


def _no_match(api, entry: _Entry, paths: list[str], what: str) -> ValueError:
    close = difflib.get_close_matches(entry.key, paths, n=3, cutoff=0.5)
    hint = f" Close {what}s: {close}." if close else f" Some {what}s: {paths[:6]}."
    return ValueError(
        f"{api}: plan key {entry.key!r} ({entry.shown}) matches no {what}.{hint} Keys "
        f"are dotted {what}s with fnmatch patterns per atom ('blocks.*.attn.w[qkv]')."
    )


def _spec(placement, axis, ndim) -> P:
    if isinstance(placement, Shard):
        return P(*([None] * (placement.dim % ndim)), axis)
    return P()


# ---------------------------------------------------------------------------------------
# Modules: parameter specs and the styles bound to each module
# ---------------------------------------------------------------------------------------

_LINEAR, _EMBEDDING, _CONV1D, _OTHER = "linear", "embedding", "conv1d", "other"


def _module_kind(m: nn.Module) -> str:
    if isinstance(m, nn.Linear):
        return _LINEAR
    if isinstance(m, nn.Embedding):
        return _EMBEDDING
    if type(m).__name__ == "Conv1D" and type(m).__module__.startswith("transformers."):
        return _CONV1D
    return _OTHER


def _module_specs(root: nn.Module, entries, mesh, axis, api):
    """``({param path: P}, {id(module): [_Bound]})``."""
    modules = list(root.named_modules())
    paths = [p for p, _ in modules]
    assigned: dict[int, tuple] = {}           # id(param) -> (placement, key, module path)
    bound: dict[int, list] = {}
    for entry in entries:
        hits = [(p, m) for p, m in modules if _matches(entry.atoms, tuple(p.split(".")) if p else ())]
        if not hits and entry.named and entry.atoms:
            # transformers' plans may name a parameter ("norm.weight"): its module
            hits = [(p, m) for p, m in modules
                    if _matches(entry.atoms[:-1], tuple(p.split(".")) if p else ())
                    and any(fnmatch.fnmatchcase(n, entry.atoms[-1])
                            for n, _ in m.named_parameters(recurse=False))]
        if not hits:
            raise _no_match(api, entry, [p for p in paths if p], "module path")
        for path, m in hits:
            kind = _module_kind(m)
            if entry.refused:
                raise ValueError(
                    f"{api}: plan[{entry.key!r}] = {entry.shown} on module "
                    f"{path or '<root>'!r} ({type(m).__name__}) is refused: {entry.refused}"
                )
            for style in entry.styles:
                where = f"{api}: plan[{entry.key!r}] = {style!r} on module {path or '<root>'!r} ({type(m).__name__})"
                _check_style_fits(style, kind, where)
                for pname, t in _style_params(style, m, kind):
                    placement = _param_placement(style, kind, pname, t.ndim, where)
                    if placement is None:
                        continue
                    full = f"{path}.{pname}" if path else pname
                    _assign(assigned, t, placement, entry.key, full, axis, where)
                bound.setdefault(id(m), []).append(_Bound(style, kind, path or "<root>", entry.key, axis, mesh))
    specs = {}
    for name, t in root.named_parameters():
        placement = assigned.get(id(t), (Replicate(),))[0]
        spec = _spec(placement, axis, t.ndim)
        check_spec(spec, t.shape, mesh, f"{api}: parameter {name!r} (shape {tuple(t.shape)}) as {spec!r}")
        specs[name] = spec
    return specs, bound


def _check_style_fits(style: Style, kind: str, where: str) -> None:
    if style.kind in ("colwise", "rowwise"):
        if kind == _CONV1D:
            split = ("weight P(None, axis), bias P(axis)" if style.kind == "colwise"
                     else "weight P(axis), bias P()")
            raise TypeError(
                f"{where}: {style.kind} applies to nn.Linear and nn.Embedding modules only; "
                f"transformers' Conv1D (GPT-2's layers) keeps its weight as [in, out], the "
                f"transpose of nn.Linear's, and is refused rather than guessed. Give its "
                f"parameters specs by hand ({style.kind}: {split}), or train it data "
                f"parallel."
            )
        if kind == _OTHER:
            raise TypeError(
                f"{where}: {style.kind} applies to nn.Linear and nn.Embedding modules only "
                f"(as torch's {'Colwise' if style.kind == 'colwise' else 'Rowwise'}Parallel); put "
                f"it on the Linear/Embedding children, or give this module's parameters "
                f"specs by hand."
            )
        if style.embedding and kind != _EMBEDDING:
            raise TypeError(f"{where}: embedding=True, but the module is not an nn.Embedding.")


def _style_params(style: Style, m: nn.Module, kind: str):
    if style.kind in ("colwise", "rowwise"):
        return list(m.named_parameters())
    if style.kind == "sequence_parallel":
        return list(m.named_parameters())
    return []


def _param_placement(style: Style, kind: str, pname: str, ndim: int, where: str):
    """The placement over the plan's axis of parameter ``pname`` under ``style``;
    None: the style leaves it alone. ``kind``: the module's (linear, embedding), or
    "param" for a tensor of a params pytree (2-D: a Linear weight, 1-D: its bias)."""
    if style.kind == "sequence_parallel":
        return Replicate()
    if style.kind not in ("colwise", "rowwise"):
        return None
    if kind == _EMBEDDING:
        return Shard(1) if style.kind == "colwise" else Shard(0)
    if style.kind == "colwise":          # torch: every parameter of the Linear on dim 0
        return Shard(0)
    is_weight = ndim == 2 if kind == "param" else pname.rsplit(".", 1)[-1] == "weight"
    is_bias = ndim == 1 if kind == "param" else pname.rsplit(".", 1)[-1] == "bias"
    return Shard(1) if is_weight else Replicate() if is_bias else None


def _assign(assigned, t, placement, key, full, axis, where) -> None:
    """Record ``t``'s placement; a second, different one is an error."""
    prev = assigned.get(id(t))
    if prev is None:
        assigned[id(t)] = (placement, key, full)
    elif prev[0] != placement:
        tied = prev[2] != full
        raise ValueError(
            f"{where}: parameter {full!r} would be {_spec(placement, axis, t.ndim)!r} here, "
            f"but plan key {prev[1]!r} made it"
            f"{f' (tied: the same tensor as {prev[2]!r})' if tied else ''} "
            f"{_spec(prev[0], axis, t.ndim)!r}; a tensor has one layout. "
            f"{'Untie the weights, or give' if tied else 'Give'} the two keys styles that agree."
        )


# ---------------------------------------------------------------------------------------
# Params pytrees
# ---------------------------------------------------------------------------------------

def _params_specs(params, entries, mesh, axis):
    api = "specs_from_plan"
    paths, leaves, treedef = optree.tree_flatten_with_path(params, none_is_leaf=True)
    atoms = [tuple(a for k in path for a in str(k).split(".")) for path in paths]
    names = [".".join(a) for a in atoms]
    assigned: dict[int, tuple] = {}
    for entry in entries:
        n = len(entry.atoms)
        hits = [i for i, a in enumerate(atoms) if len(a) >= n and _matches(entry.atoms, a[:n])]
        if not hits:
            raise _no_match(api, entry, names, "parameter path")
        for i in hits:
            t = leaves[i]
            if not isinstance(t, torch.Tensor):
                continue
            if entry.refused:
                raise ValueError(
                    f"{api}: plan[{entry.key!r}] = {entry.shown} on {names[i]!r} is "
                    f"refused: {entry.refused}"
                )
            for style in entry.styles:
                where = f"{api}: plan[{entry.key!r}] = {style!r} on {names[i]!r} (shape {tuple(t.shape)})"
                if style.kind in ("colwise", "rowwise") and t.ndim not in (1, 2):
                    raise ValueError(
                        f"{where}: {style.kind} expects 2-D weights ([out, in], as "
                        f"nn.Linear) and 1-D biases in a params pytree; give this tensor "
                        f"its spec by hand."
                    )
                kind = _EMBEDDING if style.embedding else "param"
                if style.embedding and t.ndim != 2:
                    raise ValueError(f"{where}: embedding=True expects a 2-D table.")
                placement = _param_placement(style, kind, names[i], t.ndim, where)
                if placement is None:
                    continue
                _assign(assigned, t, placement, entry.key, names[i], axis, where)
    out = []
    for i, t in enumerate(leaves):
        if not isinstance(t, torch.Tensor):
            out.append(None)
            continue
        placement = assigned.get(id(t), (Replicate(),))[0]
        spec = _spec(placement, axis, t.ndim)
        check_spec(spec, t.shape, mesh, f"{api}: {names[i]!r} (shape {tuple(t.shape)}) as {spec!r}")
        out.append(spec)
    return optree.tree_unflatten(treedef, out)


# ---------------------------------------------------------------------------------------
# Activation layouts: the boundaries of a module
# ---------------------------------------------------------------------------------------

# NOTE [A style's boundary: forward and backward layouts]
# torch's styles redistribute a module's input or output from the layout it has
# (``src``: input_layouts, or what the module computes, e.g. a pending sum after a
# row-parallel matmul) to the layout wanted (``dst``), and DTensor's backward of that
# redistribute brings the gradient back to ``src`` (a pending sum's gradient is
# replicated). A boundary here is the same pair: forward, the value is constrained to
# ``src`` (so its producer computes in that layout) and then to ``dst``; backward,
# the cotangent is constrained to ``src`` only, and where ``src == dst`` not at all
# (as for a DTensor input already in place: no redistribute, no backward). This is
# what makes sequence parallelism reduce-scatter: the gradient arriving at an
# attention input laid out (Shard(1) -> Replicate) is the pending sum of the q, k, v
# input gradients, and constraining it to Shard(1) is a reduce-scatter. Constraining
# it to Replicate on the way (the transpose JAX gives a plain sharding constraint)
# would be an all-reduce followed by a slice.

@dataclass(frozen=True)
class _Boundary:
    src: Placement | None       # None: as computed (no forward constraint, no backward)
    dst: Placement


@dataclass
class _Bound:
    """A style bound to one module: its boundaries, resolved to placements."""

    style: Style
    kind: str
    path: str
    key: str
    axis: str
    mesh: Mesh
    args: list = field(default_factory=list)      # per positional input: _Boundary | None
    kwargs: dict = field(default_factory=dict)    # name -> _Boundary
    outputs: list = field(default_factory=list)   # per output: _Boundary | None
    first_only: bool = True                        # only args[0] / the one output

    def __post_init__(self):
        s, pl = self.style, self._placement
        where = self.where
        if s.kind == "colwise":
            self.args = [_Boundary(pl(s.input_layouts, "input_layouts") or Replicate(), Replicate())]
            self.outputs = [_Boundary(Shard(-1), pl(s.output_layouts, "output_layouts") or Shard(-1))]
        elif s.kind == "rowwise":
            wanted = Replicate() if self.kind == _EMBEDDING else Shard(-1)
            self.args = [_Boundary(pl(s.input_layouts, "input_layouts") or Shard(-1), wanted)]
            self.outputs = [_Boundary(Partial(), pl(s.output_layouts, "output_layouts") or Replicate())]
        elif s.kind == "sequence_parallel":
            self.args = [_Boundary(None, Shard(s.sequence_dim))]
            self.outputs = [_Boundary(None, Shard(s.sequence_dim))]
        elif s.kind == "prepare_input":
            self.first_only = False
            if s.input_layouts is not None:
                self.args = [
                    self._pair(src, dst, f"input_layouts[{i}]")
                    for i, (src, dst) in enumerate(zip(s.input_layouts, s.desired_input_layouts))
                ]
            dkw = dict(s.desired_input_kwarg_layouts or ())
            for name, src in (s.input_kwarg_layouts or ()):
                b = self._pair(src, dkw.get(name), f"input_kwarg_layouts[{name!r}]")
                if b is not None:
                    self.kwargs[name] = b
        elif s.kind == "prepare_output":
            self.first_only = False
            self.outputs = [
                self._pair(src, dst, f"output_layouts[{i}]")
                for i, (src, dst) in enumerate(zip(s.output_layouts, s.desired_output_layouts))
            ]
        for b in [*self.args, *self.kwargs.values(), *self.outputs]:
            if b is not None and _torch.is_partial(b.dst):
                raise ValueError(
                    f"{where}: a module boundary cannot be laid out as a pending sum "
                    f"({b.dst!r}); use Replicate() (an all-reduce) or Shard(d) (a "
                    f"reduce-scatter)."
                )

    @property
    def where(self) -> str:
        return f"{self.style!r} (plan key {self.key!r}) on module {self.path!r}"

    def _placement(self, layout, name):
        return _placement(layout, self.axis, f"{self.where}: {name}")

    def _pair(self, src, dst, name):
        src = self._placement(src, name)
        if src is None:
            return None
        dst = self._placement(dst, "desired_" + name) or src
        return _Boundary(src, dst)


def _placement(layout, axis: str, where: str):
    """A layout over ``axis`` (Placement, P or None) as a Placement (or None)."""
    if layout is None:
        return None
    if isinstance(layout, P):
        dims = [d for d, e in enumerate(layout) if e is not None]
        entries = [layout[d] for d in dims]
        if not dims:
            return Replicate()
        if len(dims) == 1 and entries[0] in (axis, (axis,)):
            return Shard(dims[0])
        raise ValueError(
            f"{where} is {layout!r}; a plan's layouts are over its axis {axis!r} only "
            f"(e.g. P(None, {axis!r}) for dim 1 split, P() for replicated); other mesh "
            f"axes keep their layouts."
        )
    if isinstance(layout, Shard) and type(layout) is Shard:
        return layout
    if isinstance(layout, Replicate) or _torch.is_partial(layout):
        return layout
    raise TypeError(
        f"{where} is {layout!r}; expected Shard(d), Replicate(), Partial() or a P over "
        f"axis {axis!r}."
    )


# -- the hooks ------------------------------------------------------------------------------

def _tracing() -> bool:
    """Apply layouts only while pjit traces the global program (not eagerly, and not
    inside a shard_map body, which sees local shards)."""
    return in_global_trace() and _manual.active() is None


class _InputHook:
    def __init__(self, bound: list):
        self.bound = bound

    def __call__(self, module, args, kwargs):
        if not _tracing():
            return None
        args = list(args)
        for b in self.bound:
            if b.first_only and b.args:
                if not args or not isinstance(args[0], torch.Tensor):
                    raise TypeError(
                        f"{b.where}: expects the module's input tensor as its first "
                        f"positional argument; got {_describe(args[0]) if args else 'none'}."
                    )
            elif b.args and len(args) != len(b.args):
                raise ValueError(
                    f"{b.where}: input_layouts has {len(b.args)} entries but the module "
                    f"was called with {len(args)} positional inputs; give one layout (or "
                    f"None) per positional input."
                )
            for i, bd in enumerate(b.args):
                if bd is not None:
                    args[i] = _lay_out(args[i], bd, b, f"input {i}")
            for name, bd in b.kwargs.items():
                if name in kwargs:
                    kwargs[name] = _lay_out(kwargs[name], bd, b, f"keyword input {name!r}")
        return tuple(args), kwargs


class _OutputHook:
    def __init__(self, bound: list):
        self.bound = bound

    def __call__(self, module, args, output):
        if not _tracing():
            return None
        for b in self.bound:
            if not b.outputs:
                continue
            if b.first_only:
                output = _lay_out(output, b.outputs[0], b, "output")
                continue
            single = not isinstance(output, tuple)
            outs = [output] if single else list(output)
            if len(outs) != len(b.outputs):
                raise ValueError(
                    f"{b.where}: output_layouts has {len(b.outputs)} entries but the "
                    f"module returned {len(outs)} outputs; give one layout (or None) per "
                    f"output."
                )
            outs = [o if bd is None else _lay_out(o, bd, b, f"output {i}")
                    for i, (o, bd) in enumerate(zip(outs, b.outputs))]
            output = outs[0] if single else tuple(outs)
        return output


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def _lay_out(x, bd: _Boundary, b: _Bound, what: str):
    where = f"{b.where}, {what}"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{where}: expected a tensor to lay out; got {_describe(x)}.")
    if isinstance(x, DTensor):
        raise TypeError(
            f"{where} is a DTensor inside pjit's trace; parallelize's layouts apply to "
            f"the plain tensors of a traced program. Call the module on plain tensors."
        )
    src = _normalize(bd.src, x, where, b)
    dst = _normalize(bd.dst, x, where, b)
    fwd = [dst] if (src is None or _torch.is_partial(src) or src == dst) else [src, dst]
    bwd = None
    if src is not None and src != dst:
        bwd = Replicate() if _torch.is_partial(src) else src
    layouts = tuple(_layout(b.axis, p, where) for p in fwd)
    back = None if bwd is None else _layout(b.axis, bwd, where)
    return _Layout.apply(x, layouts, back)


def _normalize(p, x, where, b: _Bound):
    if isinstance(p, Shard):
        if not -x.ndim <= p.dim < x.ndim:
            raise ValueError(
                f"{where}: layout {p!r} names dim {p.dim}, but the tensor has shape "
                f"{tuple(x.shape)}."
            )
        p = Shard(p.dim % x.ndim)
        n = b.mesh.size(b.axis)
        if x.shape[p.dim] % n:
            raise ValueError(
                f"{where}: layout {p!r} splits dim {p.dim} (size {x.shape[p.dim]}) over "
                f"mesh axis {b.axis!r} (size {n}), which does not divide it; change the "
                f"shapes (e.g. the sequence length) or the style. (Uneven shards are not "
                f"supported.)"
            )
    return p


# -- the op: a layout over one mesh axis ---------------------------------------------------

# A custom op's arguments are tensors and plain values, so the op names its placement
# by an index into this table; the mesh axis and the text for messages are arguments
# of the op itself, owned by the graph. The table is bounded by the distinct
# placements (Shard of each dim, Replicate, Partial per reduce op), however many
# plans, modules and models a process traces.
_PLACEMENT_IDS: dict[Placement, int] = {}
_PLACEMENTS: list[Placement] = []


def _placement_id(placement: Placement) -> int:
    i = _PLACEMENT_IDS.get(placement)
    if i is None:
        i = _PLACEMENT_IDS[placement] = len(_PLACEMENTS)
        _PLACEMENTS.append(placement)
    return i


def _layout(axis: str, placement: Placement, where: str) -> tuple:
    """A layout over one mesh axis as the op's arguments: (axis, placement id, where)."""
    return axis, _placement_id(placement), where


@torch.library.custom_op("sharded::axis_layout", mutates_args=())
def _axis_layout(x: torch.Tensor, axis: str, placement_id: int, where: str) -> torch.Tensor:
    return x.clone()


@_axis_layout.register_fake
def _(x, axis, placement_id, where):
    return torch.empty_like(x)


AXIS_LAYOUT_OP = torch.ops.sharded.axis_layout.default


class _Layout(torch.autograd.Function):
    """Forward: the layouts ``fwd`` in turn; backward: the cotangent laid out as
    ``bwd`` (None: left as it comes). Each layout is ``_layout``'s (axis, placement
    id, where). NOTE [A style's boundary]."""

    @staticmethod
    def forward(x, fwd, bwd):
        for layout in fwd:
            x = AXIS_LAYOUT_OP(x, *layout)
        return x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.bwd = inputs[2]

    @staticmethod
    def backward(ctx, grad):
        if ctx.bwd is None:
            return grad, None, None
        return _Layout.apply(grad, (ctx.bwd,), None), None, None

    @staticmethod
    def vmap(info, in_dims, x, fwd, bwd):
        """Under torch.func.vmap the layouts name the logical dims: with the vmapped
        dim moved to the front, a split of dim d is one of physical dim d + 1."""
        if in_dims[0] is None:
            return _Layout.apply(x, fwd, bwd), None
        x = x.movedim(in_dims[0], 0)
        fwd = tuple(_shifted(layout) for layout in fwd)
        return _Layout.apply(x, fwd, None if bwd is None else _shifted(bwd)), 0


def _shifted(layout: tuple) -> tuple:
    axis, placement_id, where = layout
    placement = _PLACEMENTS[placement_id]
    if isinstance(placement, Shard):
        placement = Shard(placement.dim + 1)
    return _layout(axis, placement, where)


def _expand_axis_layout(ex, node, args, kwargs):
    """Redistribute to the layout over one mesh axis; the other axes keep theirs."""
    x, axis, placement_id, where = args
    placement = _PLACEMENTS[placement_id]
    mesh = ex.mesh
    if axis not in mesh.axis_names:
        raise ValueError(
            f"{where}: the plan lays out mesh axis {axis!r}, but pjit's mesh {mesh!r} "
            f"has no such axis; parallelize with the axis of the mesh pjit runs on."
        )
    x = ex.as_dtensor(x)
    i = mesh.axis_names.index(axis)
    # A masked pending sum (a row-split embedding's output) applies its ids mask when
    # reduced, valid only on the shape the embedding produced: reduce it on the other
    # axes before this one changes (a split of the rows here would leave the mask
    # behind, and the program fail at run time).
    masked = [j for j, p in enumerate(x.placements)
              if j != i and _torch.is_partial(p) and not _torch.is_plain_partial(p)]
    if masked and x.placements[i] != placement:
        x = ex.redistribute(x, [Replicate() if j in masked else p for j, p in enumerate(x.placements)])
    target = list(x.placements)
    target[i] = placement
    if isinstance(placement, Shard):
        n = 1
        for a, p in zip(mesh.axis_names, target):
            if isinstance(p, Shard) and p.dim == placement.dim:
                n *= mesh.size(a)
        if x.shape[placement.dim] % n:
            raise ValueError(
                f"{where}: dim {placement.dim} (size {x.shape[placement.dim]}) of a tensor "
                f"of shape {tuple(x.shape)} cannot be split {n} ways on {mesh!r}; change "
                f"the shapes or the style. (Uneven shards are not supported.)"
            )
    return ex.redistribute(x, target)


# The expander's handler for the op (NOTE [One registry of primitives] in
# sharded/_registry.py).
_registry.define(AXIS_LAYOUT_OP, expand=_expand_axis_layout)


# ---------------------------------------------------------------------------------------
# Modules that update buffers in place
# ---------------------------------------------------------------------------------------

class _BufferCheck:
    """Hooks on a module that owns buffers: while pjit traces, a module that would
    update a buffer in place (BatchNorm's running stats in training mode) is an error
    that names it; the traced program would drop the update (or torch.func would fail
    deep inside the module)."""

    def __init__(self, path: str):
        self.path = path
        self.stack: list[dict] = []

    def before(self, module, args):
        if not _tracing():
            return None
        if module.training and getattr(module, "track_running_stats", False) and (
                getattr(module, "running_mean", None) is not None):
            raise self._error(module, ["running_mean", "running_var"])
        self.stack.append({n: _torch.version(b) for n, b in module.named_buffers(recurse=False)})
        return None

    def after(self, module, args, output):
        if not self.stack:
            return None
        versions = self.stack.pop()
        if not _tracing():
            return None
        changed = [n for n, b in module.named_buffers(recurse=False)
                   if n in versions and _torch.version(b) != versions[n]]
        if changed:
            raise self._error(module, changed)
        return None

    def _error(self, module, names) -> RuntimeError:
        stats = getattr(module, "track_running_stats", False)
        fix = ("call model.eval() (or build it with track_running_stats=False) before "
               "tracing" if stats else "make the update functional: pass the buffer in "
               "and return its new value")
        return RuntimeError(
            f"pjit cannot trace module {self.path!r} ({type(module).__name__}): it updates "
            f"its buffer(s) {names} in place during the forward, and a traced program is "
            f"pure (the update would be lost). {fix[0].upper() + fix[1:]}, or keep the "
            f"statistics outside the traced step."
        )
