"""Dead-code elimination and common-subexpression elimination on functional graphs."""

from __future__ import annotations

import torch
import torch.fx as fx

from sharded import _torch


# In-place ops that only touch autograd metadata; DTensor's tracing leaves a few
# ``detach_`` on fresh constants behind, which plain DCE keeps as side effects.
_METADATA_INPLACE = {torch.ops.aten.detach_.default}


def _is_impure(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target in _METADATA_INPLACE:
        return False
    return node.is_impure()


def dce(gm: fx.GraphModule) -> fx.GraphModule:
    gm.graph.eliminate_dead_code(is_impure_node=_is_impure)
    return gm


# Argument types that are neither nodes nor containers: frozen as (type name, value)
# without the isinstance checks below (the hot path: CSE freezes every argument).
_ATOMS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device,
                    torch.layout, torch.memory_format})


def _freeze(x, rep):
    t = type(x)
    if t is fx.Node:
        return ("node", rep[x])
    if t in _ATOMS:
        return (t.__name__, x)
    if isinstance(x, fx.Node):
        return ("node", rep[x])
    if isinstance(x, (list, tuple)):
        out = []
        for y in x:                 # (the common elements inline: nodes and atoms)
            ty = type(y)
            if ty is fx.Node:
                out.append(("node", rep[y]))
            elif ty in _ATOMS:
                out.append((ty.__name__, y))
            else:
                out.append(_freeze(y, rep))
        return (t.__name__, tuple(out))
    if isinstance(x, dict):
        return ("dict", tuple(sorted((k, _freeze(v, rep)) for k, v in x.items())))
    return (t.__name__, x)


def _is_pure(target) -> bool:
    if not isinstance(target, _torch.OpOverload):
        return callable(target) and getattr(target, "__module__", "") == "_operator"
    if _torch.is_mutating_op(target):
        return False
    return torch.Tag.nondeterministic_seeded not in target.tags


def cse(gm: fx.GraphModule) -> fx.GraphModule:
    """Merge nodes that compute the same pure op on the same inputs.

    DTensor emits one redistribute per consumer, so a value read by several ops is
    often all-reduced or all-gathered several times; CSE keeps one collective.
    Random (nondeterministic_seeded) and mutating ops are never merged.
    """
    rep: dict[fx.Node, fx.Node] = {}
    seen: dict = {}
    pure: dict = {}                  # target -> _is_pure(target), once per target
    for node in list(gm.graph.nodes):
        rep[node] = node
        key = _cse_key(node, rep, pure)
        if key is None:
            continue
        if key in seen:
            node.replace_all_uses_with(seen[key])
            rep[node] = seen[key]
            gm.graph.erase_node(node)
        else:
            seen[key] = node
    return gm


def _cse_key(node: fx.Node, rep: dict, pure: dict | None = None):
    """What makes two nodes the same value, or None if the node must stay."""
    if node.op == "get_attr":       # the same constant read twice
        return ("get_attr", node.target)
    if node.op != "call_function":
        return None
    target = node.target
    if pure is None:
        is_pure = _is_pure(target)
    else:
        try:
            is_pure = pure[target]
        except KeyError:
            is_pure = pure[target] = _is_pure(target)
        except TypeError:           # an unhashable callable
            is_pure = _is_pure(target)
    if not is_pure:
        return None
    try:
        key = (node.target, _freeze(node.args, rep), _freeze(node.kwargs, rep))
        hash(key)
        return key
    except TypeError:
        return None


def remove_trivial_collectives(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop collectives over process groups of one rank (a mesh axis of size 1):
    DTensor still emits them, e.g. for a Partial over a ("dp"=1, "tp"=2) mesh's dp axis.
    Each is the identity on its input."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _torch.COLLECTIVE_OPS:
            continue
        if _torch.group_from_name(node.args[-1]).size() != 1:
            continue
        for user in list(node.users):
            if user.target is _torch.WAIT_OP:
                user.replace_all_uses_with(node.args[0])
                gm.graph.erase_node(user)
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
    return gm


# (a slice to its input's shape takes every element: DTensor's gather ends in one on
# every dim of more than 256, where Python's small-int cache ends)
_VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
          torch.ops.aten.reshape.default, torch.ops.aten.slice.Tensor}


def remove_identity_views(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop views and slices to the shape their input already has (the expansion
    leaves many: 149 of 204 views in a small GPT's data-parallel step). In a
    functional graph the alias is not needed; a view of an input or a constant that
    feeds an output is kept, so that no output is an input itself. An identity slice
    after a gather was the gather's reader where the parameter's readers were meant
    (``regather_distant_uses``); an identity view after a reduction read it at once,
    which ended its bucket (``_bucket``: the first read of a member's result)."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _VIEWS:
            continue
        src = node.args[0]
        a, b = getattr(src, "meta", {}).get("val"), node.meta.get("val")
        if a is None or b is None or tuple(a.shape) != tuple(b.shape):
            continue
        if src.op in ("placeholder", "get_attr") and any(u.op == "output" for u in node.users):
            continue
        node.replace_all_uses_with(src)
        gm.graph.erase_node(node)
    return gm


_LIKE_FACTORIES = {torch.ops.aten.ones_like.default: 1, torch.ops.aten.zeros_like.default: 0,
                   torch.ops.aten.full_like.default: None}


def untie_shape_reads(gm: fx.GraphModule) -> fx.GraphModule:
    """``ones_like(x)``, ``zeros_like(x)`` and ``full_like(x, v)`` read only ``x``'s
    shape, dtype and device, which the graph knows: each becomes ``full(shape, v)``, so
    it no longer waits for ``x``. A backward's seed ``ones_like(loss)`` read the loss
    after its all-reduce: the whole backward waited for the loss to cross the ranks
    (one rank idle while the other caught up, every step). Only for a contiguous ``x``
    and no other memory format asked (``full`` makes contiguous tensors)."""
    g = gm.graph
    for node in list(g.nodes):
        if node.op != "call_function" or node.target not in _LIKE_FACTORIES:
            continue
        x, val = node.args[0], node.meta.get("val")
        xv = x.meta.get("val") if isinstance(x, fx.Node) else None
        kw = dict(node.kwargs)
        if not isinstance(xv, torch.Tensor) or not isinstance(val, torch.Tensor) or not xv.is_contiguous() \
                or kw.pop("memory_format", None) not in (None, torch.preserve_format, torch.contiguous_format):
            continue
        fill = _LIKE_FACTORIES[node.target]
        fill = node.args[1] if fill is None else fill
        kw.update(dtype=val.dtype, layout=val.layout, device=val.device)
        kw.pop("pin_memory", None)
        with g.inserting_before(node):
            new = g.call_function(torch.ops.aten.full.default, (list(val.shape), fill), kw)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        g.erase_node(node)
    return gm


def unalias_outputs(gm: fx.GraphModule, n: int | None = None) -> bool:
    """Give each of the first ``n`` outputs (all: None) a storage of its own; True if
    the graph changed (then ``gm.recompile()``).

    CSE merges equal computations: ``adamw_init``'s two ``zeros_like`` per parameter
    became one tensor, returned as both moments, and a caller that updated one in
    place (``m.add_``, torch.optim on the state) changed the other too, where the
    single-device program returns two tensors: a silent wrong result. An output whose
    storage an earlier one already has (the same node, or a view of it) is cloned.
    """
    out = next(n_ for n_ in reversed(gm.graph.nodes) if n_.op == "output")
    outs = out.args[0]
    if not isinstance(outs, (list, tuple)):
        return False
    args = list(outs)
    seen: set = set()
    changed = False
    for i, a in enumerate(args[: len(args) if n is None else n]):
        val = a.meta.get("val") if isinstance(a, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            continue
        key = _torch.storage_key(val)
        if key not in seen:
            seen.add(key)
            continue
        with gm.graph.inserting_before(out):
            copy = gm.graph.call_function(torch.ops.aten.clone.default, (a,))
        copy.meta["val"] = torch.empty_like(val)
        args[i] = copy
        changed = True
    if changed:
        out.args = (type(outs)(args),) + tuple(out.args[1:])
    return changed
