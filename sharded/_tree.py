"""Pytree helpers: specs given as pytree prefixes, with key paths in every error.

Pytrees are optree pytrees with ``None`` as a leaf (so an argument that is None is a
static leaf, and a spec that is None means "replicated"), in optree's ``"sharded"``
namespace: the built-in containers, plus the types registered with
``register_dataclass`` / ``register_pytree_node``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import optree

from sharded.spec import AUTO, P

NONE_IS_LEAF = True
NAMESPACE = "sharded"

__all__ = ["register_dataclass", "register_pytree_node"]


def register_dataclass(cls: type) -> type:
    """Make instances of the dataclass ``cls`` pytree nodes whose children are its
    fields (those set by ``__init__``), so that pjit, shard_map and shard see the
    tensors inside them (in arguments and in outputs). Usable as a decorator; frozen
    dataclasses work too. Paths in errors read ``args[0].field``."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"register_dataclass expects a dataclass type; got {cls!r}.")
    names = tuple(f.name for f in dataclasses.fields(cls) if f.init)

    def flatten_fn(x):
        return [getattr(x, n) for n in names], None, names

    def unflatten_fn(_, children):
        return cls(**dict(zip(names, children)))

    optree.register_pytree_node(cls, flatten_fn, unflatten_fn,  # type: ignore[arg-type]
                                path_entry_type=optree.GetAttrEntry, namespace=NAMESPACE)
    return cls


def register_pytree_node(cls: type, flatten_fn: Callable, unflatten_fn: Callable) -> type:
    """Register a container type (``flatten_fn(x) -> (children, aux, keys)``,
    ``unflatten_fn(aux, children) -> x``, as optree's) for pjit, shard_map and shard."""
    optree.register_pytree_node(cls, flatten_fn, unflatten_fn, namespace=NAMESPACE)
    return cls


def flatten(tree):
    return optree.tree_flatten(tree, none_is_leaf=NONE_IS_LEAF, namespace=NAMESPACE)


def unflatten(treedef, leaves):
    return optree.tree_unflatten(treedef, leaves)


def is_spec_leaf(x) -> bool:
    return x is None or isinstance(x, P) or x is AUTO


def spec_leaves(specs) -> list:
    """The spec leaves (P, None, AUTO) of a spec tree."""
    return optree.tree_leaves(specs, is_leaf=is_spec_leaf, none_is_leaf=True, namespace=NAMESPACE)


def fmt_entry(kind, entry) -> str:
    if kind == optree.PyTreeKind.DICT or kind == optree.PyTreeKind.DEFAULTDICT or kind == optree.PyTreeKind.ORDEREDDICT:
        return f"[{entry!r}]"
    if kind == optree.PyTreeKind.NAMEDTUPLE or kind == optree.PyTreeKind.STRUCTSEQUENCE:
        return f".{entry}" if isinstance(entry, str) else f"[{entry}]"
    if kind == optree.PyTreeKind.CUSTOM and isinstance(entry, str) and entry.isidentifier():
        return f".{entry}"
    return f"[{entry!r}]"


def broadcast_prefix(
    prefix: Any,
    tree: Any,
    name: str,
    *,
    is_leaf: Callable[[Any], bool] = is_spec_leaf,
) -> list[tuple[str, Any]]:
    """For each leaf of ``tree`` (in flatten order), the (path, value) of the ``prefix``
    leaf that covers it. ``name`` starts every path (e.g. ``"pjit in_specs"``)."""
    out: list[tuple[str, Any]] = []
    _walk(prefix, tree, name, out, is_leaf)
    return out


def _children(x):
    children, _meta, entries, _ = optree.tree_flatten_one_level(
        x, none_is_leaf=NONE_IS_LEAF, namespace=NAMESPACE)
    kind = optree.tree_structure(x, none_is_leaf=NONE_IS_LEAF, namespace=NAMESPACE).kind
    return children, entries, kind


def _walk(pfx, sub, path, out, is_leaf):
    if is_leaf(pfx):
        n = len(optree.tree_leaves(sub, none_is_leaf=NONE_IS_LEAF, namespace=NAMESPACE))
        out.extend([(path, pfx)] * n)
        return
    if optree.treespec_is_leaf(optree.tree_structure(pfx, none_is_leaf=NONE_IS_LEAF,
                                                     namespace=NAMESPACE)):
        hint = f" Did you mean P({pfx!r})?" if isinstance(pfx, str) else ""
        raise TypeError(f"{path} is {pfx!r}; expected P(...), None, or a container.{hint}")
    sub_struct = optree.tree_structure(sub, none_is_leaf=NONE_IS_LEAF, namespace=NAMESPACE)
    if optree.treespec_is_leaf(sub_struct):
        raise ValueError(
            f"{path} is a {type(pfx).__name__}, but the argument there is "
            f"{_describe(sub)}; the specs must be a pytree prefix of the arguments "
            f"(use one P for the whole subtree)."
        )
    pch, pent, pkind = _children(pfx)
    sch, sent, skind = _children(sub)
    if type(pfx) is not type(sub) and not (
        isinstance(pfx, (list, tuple)) and isinstance(sub, (list, tuple))
        and pkind == skind
    ):
        raise ValueError(
            f"{path} is a {type(pfx).__name__}, but the argument there is a "
            f"{type(sub).__name__}; the specs must be a pytree prefix of the arguments."
        )
    if list(pent) != list(sent):
        if isinstance(pfx, dict):
            missing = sorted(set(sent) - set(pent), key=repr)
            extra = sorted(set(pent) - set(sent), key=repr)
            detail = []
            if missing:
                detail.append(f"no spec for key(s) {missing}")
            if extra:
                detail.append(f"spec for key(s) {extra} not in the argument")
            raise ValueError(
                f"{path} does not match the argument's keys: {'; '.join(detail)}."
            )
        raise ValueError(
            f"{path} has {len(pch)} entries but the argument there has {len(sch)}; "
            f"the specs must be a pytree prefix of the arguments."
        )
    for e, p, s in zip(sent, pch, sch):
        _walk(p, s, path + fmt_entry(skind, e), out, is_leaf)


def _describe(x) -> str:
    import torch

    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return f"{type(x).__name__} {x!r}"[:80]


def leaf_paths(tree, name: str) -> list[str]:
    """Key path of every leaf of ``tree``, e.g. ``args[0]['w']``."""
    accessors, _leaves, _ = optree.tree_flatten_with_accessor(
        tree, none_is_leaf=NONE_IS_LEAF, namespace=NAMESPACE)
    return [a.codify(name) for a in accessors]


def arg_specs(specs, args: tuple, name: str, excluded: str = "") -> list[tuple[str, Any]]:
    """``broadcast_prefix`` for a transform's ``in_specs``: a single P/None covers every
    positional arg; otherwise one entry (a spec or pytree of specs) per arg.
    ``excluded`` explains args not counted (e.g. " (static_argnums excluded)")."""
    if not is_spec_leaf(specs):
        if not isinstance(specs, (tuple, list)):
            raise TypeError(
                f"{name} in_specs must be a P, None, or a tuple with one entry per "
                f"positional argument; got {type(specs).__name__}."
            )
        if len(specs) != len(args):
            raise ValueError(
                f"{name} in_specs has {len(specs)} entries but the call has {len(args)} "
                f"positional args{excluded}; give one spec (or pytree of specs) per argument."
            )
        specs = tuple(specs)
    return broadcast_prefix(specs, args, f"{name} in_specs")
