"""pjit's arguments: static and donated arguments by position and by name, in_specs
matched to the call's leaves, the call's signature (the cache key), and the checks
that name a bad argument by its path (``args[0]['w']``)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from dataclasses import dataclass
from typing import Any, Callable

import numbers

import torch
from torch.distributed.tensor import DTensor

from sharded import _torch, _tree
from sharded._fingerprint import ambient
from sharded.mesh import Mesh, slice_of
from sharded.spec import AUTO, P, check_spec, to_placements


class _Unspecified:
    def __repr__(self):
        return "UNSPECIFIED"


UNSPECIFIED = _Unspecified()

VMAP = (
    "{name} was called inside torch.func.vmap; a pjit call cannot be batched from "
    "outside. Put vmap inside the function instead: pjit(torch.func.vmap(f), ...)."
)


@dataclass
class Signature:
    mesh: Mesh
    leaves: list                 # flat leaves of the dynamic args (then dynamic kwargs)
    treedef: Any                 # of the dynamic args, or of (args, kwargs) with keywords
    static_args: tuple
    static_argnums: tuple        # normalized for this call
    key: tuple
    ambient: tuple = ()
    static_kwargs: dict | None = None   # None: called without keyword arguments
    grad: tuple | None = None    # per tensor leaf: requires grad (None: the no-grad path)



def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _tuple_of(value, is_one, one_or_many: str, many: str, what: str, api: str) -> tuple:
    """``value`` (one item or a sequence of items, each passing ``is_one``) as a tuple;
    ``one_or_many`` and ``many`` describe the items in the errors."""
    if is_one(value):
        value = (value,)
    try:
        value = tuple(value)
    except TypeError:
        raise TypeError(f"{api}: {what} must be {one_or_many}; got {value!r}.") from None
    for x in value:
        if not is_one(x):
            raise TypeError(f"{api}: {what} must be {many}; got {x!r} in {value!r}.")
    return value


def _argnums(fn, nums, what: str, api: str) -> tuple:
    """``static_argnums``/``donate_argnums`` as a sorted tuple; negative numbers are
    resolved against ``fn``'s positional parameters when its signature says how many
    there are (no ``*args``), else per call (as JAX does)."""
    nums = _tuple_of(nums, _is_int, "an int or a sequence of ints", "ints", what, api)
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        params = None
    if params is not None and not any(p.kind is p.VAR_POSITIONAL for p in params):
        n = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
        return _resolve_argnums(nums, n, api, what, f"the function takes {n} positional argument(s)")
    if len(set(nums)) != len(nums):
        raise ValueError(f"{api}: {what} {nums!r} names an argument twice.")
    return tuple(sorted(nums))


def _resolve_argnums(nums: tuple, n: int, api: str, what: str, against: str) -> tuple:
    """``nums`` as sorted indices in [0, n), negative ones counted from the end;
    ``against`` says what ``n`` counts (for the error)."""
    out = []
    for i in nums:
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise ValueError(
                f"{api}: {what} has {i}, but {against}; {what} index the positional "
                f"arguments (negative ones count from the end)."
            )
        out.append(j)
    if len(set(out)) != len(out):
        raise ValueError(f"{api}: {what} {tuple(nums)!r} names an argument twice.")
    return tuple(sorted(out))


# NOTE [Keyword arguments]
# A call may pass arguments by keyword. Keywords named in ``static_argnames`` are static
# (hashable Python values in the cache key, as static_argnums); the others are dynamic
# inputs like positional ones: their tensors are program inputs, their other leaves
# static. ``in_specs`` lays them out: a single P covers them too; a tuple covers the
# positional arguments and keyword tensors are replicated (P()); a dict names arguments
# by parameter name, positional or keyword, and an argument it does not name is
# replicated. As in JAX, a name and a position that denote the same parameter (via
# inspect.signature) are the same argument for static_argnums/static_argnames and for
# donate_argnums/donate_argnames. Paths in messages read ``kwargs['mask']``.

@dataclass(frozen=True)
class _Params:
    positional: tuple            # names of the positional parameters, in order
    keywords: frozenset | None   # names accepted by keyword (None: the function has **kwargs)
    names: tuple                 # every parameter, for messages
    varargs: bool                # the function has *args


def _argnums_for(nums: tuple, nargs: int, params: "_Params | None", api: str, what: str) -> tuple:
    """``nums`` for a call with ``nargs`` positional args: for a function without
    ``*args`` they were resolved when pjit was called, and those beyond the call's
    positional args are passed by keyword (or take their default); otherwise they are
    resolved now, negative ones from the end."""
    if all(0 <= i < nargs for i in nums):
        return nums                                  # the common case, resolved
    if params is not None and not params.varargs:
        return tuple(i for i in nums if i < nargs)
    return _resolve_argnums(nums, nargs, api, what, f"the call has {nargs} positional args")


def _parameters(fn) -> _Params | None:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    keywords = None if any(p.kind is p.VAR_KEYWORD for p in params) else frozenset(
        p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    names = tuple(("*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else "")
                  + p.name for p in params)
    return _Params(positional, keywords, names, any(p.kind is p.VAR_POSITIONAL for p in params))


def _both(fn, params: _Params | None, nums, names, what: str, api: str) -> tuple[tuple, frozenset]:
    """``{what}_argnums`` and ``{what}_argnames`` completed from each other through the
    signature (NOTE [Keyword arguments])."""
    nums = _argnums(fn, nums, f"{what}_argnums", api)
    names = _tuple_of(names, lambda k: isinstance(k, str), "a str or a sequence of str", "strs",
                      f"{what}_argnames", api)
    for k in names:
        if params is not None and params.keywords is not None and k not in params.keywords \
                and k not in params.positional:
            raise ValueError(
                f"{api}: {what}_argnames has {k!r}, but the function has no parameter of that "
                f"name; it takes ({', '.join(params.names)})."
            )
    if params is None:
        return nums, frozenset(names)
    pos = params.positional
    nums = tuple(sorted(set(nums) | {pos.index(k) for k in names if k in pos}))
    names = frozenset(names) | {pos[i] for i in nums if 0 <= i < len(pos)}
    return nums, names


def _check_in_specs_names(in_specs, params: _Params | None, static: frozenset, api: str) -> None:
    if not isinstance(in_specs, dict):
        return
    for k in in_specs:
        if not isinstance(k, str):
            raise TypeError(f"{api}: in_specs as a dict names arguments by parameter name; "
                            f"got key {k!r}.")
        if k in static:
            raise ValueError(f"{api}: in_specs[{k!r}] names a static argument; static "
                             f"arguments take no spec.")
        if params is not None and params.keywords is not None and k not in params.keywords \
                and k not in params.positional:
            raise ValueError(
                f"{api}: in_specs[{k!r}] names no parameter of the function; it takes "
                f"({', '.join(params.names)})."
            )


_PLAIN_STATIC = frozenset({type(None), bool, int, float, complex, str, bytes, torch.dtype,
                           torch.device, P})
_OUTPUT_LEAVES = (torch.Tensor, type(None), bool, int, float, complex, str)


def _dyn_paths(args, nums, dyn_kw: dict | None = None) -> list[str]:
    paths = []
    for i, a in enumerate(args):
        if i not in nums:
            paths.extend(_tree.leaf_paths(a, f"args[{i}]"))
    if dyn_kw:
        paths.extend(_tree.leaf_paths(dyn_kw, "kwargs"))
    return paths


def _dyn_path(args, nums, dyn_kw, j) -> str:
    return _dyn_paths(args, nums, dyn_kw)[j]


def _holds_tensors(x) -> str | None:
    """Why the non-tensor leaf ``x`` hides tensors from pjit, or None."""
    if isinstance(x, torch.nn.Module):
        return (f"an nn.Module ({type(x).__name__}); pass its parameters instead, e.g. "
                f"dict(model.named_parameters()), and call it inside the function with "
                f"torch.func.functional_call(model, params, (x,))")
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        names = [f.name for f in dataclasses.fields(x) if _tensorish(getattr(x, f.name, None))]
        if names:
            return (f"an instance of {type(x).__name__} (a dataclass with tensors in {names}) "
                    f"that is not a registered pytree node, so pjit cannot see its tensors; register it with "
                    f"sharded.register_dataclass({type(x).__name__})")
        return None
    if isinstance(x, (dict, list, tuple)):
        values = x.values() if isinstance(x, dict) else x
        if any(_tensorish(v) for v in values):
            return (f"an instance of {type(x).__name__} (a {type(x).__mro__[1].__name__} subclass "
                    f"that is not a registered pytree node) holding tensors; pass a plain "
                    f"{type(x).__mro__[1].__name__} or register the type with "
                    f"sharded.register_pytree_node")
        return None
    attrs = getattr(x, "__dict__", None)
    if isinstance(attrs, dict):
        names = [k for k, v in attrs.items() if _tensorish(v)]
        if names:
            return (f"an instance of {type(x).__name__} with tensor attributes {names[:5]}, which "
                    f"pjit cannot see; pass the tensors in a dict or tuple, or register the type "
                    f"(sharded.register_dataclass for a dataclass)")
    return None


def _tensorish(v) -> bool:
    if isinstance(v, (torch.Tensor, torch.nn.Module)):
        return True
    if isinstance(v, (list, tuple)) and len(v) <= 64:
        return any(isinstance(x, torch.Tensor) for x in v)
    if isinstance(v, dict) and len(v) <= 64:
        return any(isinstance(x, torch.Tensor) for x in v.values())
    return False


def _check_leaf(x, path_of: Callable[[], str], api: str) -> None:
    why = _holds_tensors(x)
    if why is not None:
        raise TypeError(f"{api}: {path_of()} is {why}.")


def _check_static_arg(v, where: str, api: str, what: str = "static_argnums") -> None:
    """A static argument is a Python value baked into the program: no tensors."""
    if type(v) in _PLAIN_STATIC:
        return
    leaves = _tree.flatten(v)[0]
    paths = None
    for k, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) or _holds_tensors(leaf) is not None:
            paths = paths or _tree.leaf_paths(v, where)
            kind = (f"a tensor of shape {tuple(leaf.shape)}" if isinstance(leaf, torch.Tensor)
                    else _holds_tensors(leaf))
            raise TypeError(
                f"{api}: {paths[k]} is static ({what}) but is {kind}. Static "
                f"arguments are Python values baked into the program (each new one traces "
                f"again); pass tensors as regular arguments with an in_specs entry."
            )


def _bad_output(api: str, path: str, v) -> str:
    tname = type(v).__name__
    if inspect.isgenerator(v) or isinstance(v, (types.GeneratorType, map, filter, zip)):
        fix = "a generator or iterator (evaluated lazily, after tracing); return a tuple or list"
    elif isinstance(v, dict):
        fix = (f"an instance of {tname}, a dict subclass that is not a registered pytree "
               f"node (e.g. a HuggingFace ModelOutput); return dict(out) (or out.to_tuple()), or register "
               f"the type with sharded.register_pytree_node")
    elif isinstance(v, (list, tuple)):
        fix = (f"an instance of {tname}, a {type(v).__mro__[1].__name__} subclass that is not "
               f"a registered pytree node; return a plain {type(v).__mro__[1].__name__} or register the type")
    elif dataclasses.is_dataclass(v):
        fix = (f"an instance of {tname}, a dataclass that is not a registered pytree node; "
               f"register it with sharded.register_dataclass({tname})")
    else:
        fix = f"an object of type {tname}"
    return (f"{api}: {path} is {fix}. Outputs must be tensors, Python scalars or None, in "
            f"tuples, lists, dicts, namedtuples or registered pytree nodes (anything else "
            f"would carry tracing values out of the function).")


class Arguments:
    """A pjit's argument configuration, normalised once (``static_argnums`` and
    ``static_argnames`` completed from each other through the signature, and so on),
    and what it says about one call."""

    def __init__(self, fn, name: str, in_specs, out_specs, static_argnums, static_argnames,
                 donate_argnums, donate_argnames, memory_budget=None, cost_model=None):
        self.fn = fn
        self.name = name
        self.in_specs = in_specs
        self.out_specs = out_specs
        # AUTO specs (docs/auto.md): whether any, the budget and the cost model
        self.auto = any(x is AUTO for x in _tree.spec_leaves((in_specs, out_specs)))
        if memory_budget is not None and not self.auto:
            raise ValueError(
                f"{name}: memory_budget is the AUTO solver's bound; no in_specs or out_specs "
                f"entry is AUTO. Give AUTO for the tensors the solver may lay out, or drop "
                f"memory_budget.")
        if memory_budget is not None and (not isinstance(memory_budget, numbers.Integral)
                                          or isinstance(memory_budget, bool) or memory_budget <= 0):
            raise ValueError(f"{name}: memory_budget must be a positive int (bytes per rank); "
                             f"got {memory_budget!r}.")
        self.memory_budget = int(memory_budget) if memory_budget is not None else None
        self.cost_model = cost_model
        self._params = _parameters(fn)
        self.static_argnums, self.static_argnames = _both(
            fn, self._params, static_argnums, static_argnames, "static", name)
        self.donate_argnums, self.donate_argnames = _both(
            fn, self._params, donate_argnums, donate_argnames, "donate", name)
        both = (set(self.static_argnums) & set(self.donate_argnums)) | (
            self.static_argnames & self.donate_argnames)
        if both:
            raise ValueError(
                f"{name}: argument(s) {sorted(both, key=str)} are both static and donated; "
                f"a static argument is a Python value, not a buffer to donate."
            )
        _check_in_specs_names(in_specs, self._params, self.static_argnames, name)

    def config(self) -> tuple:
        """The configuration as a hashable key (TypeError if a spec tree is not)."""
        return (_hashable_tree(self.in_specs), _hashable_tree(self.out_specs),
                self.static_argnums, tuple(sorted(self.static_argnames)),
                self.donate_argnums, tuple(sorted(self.donate_argnames)),
                self.memory_budget, self.cost_model)

    def signature(self, args, kwargs, mesh) -> Signature:
        nums = self._static_argnums_for(len(args))
        static = tuple(args[i] for i in nums)
        for i, v in zip(nums, static):
            _check_static_arg(v, f"args[{i}]", self.name)
        dyn = tuple(a for i, a in enumerate(args) if i not in nums)
        static_kw, dyn_kw = None, None
        if kwargs:
            static_kw, dyn_kw = self._split_kwargs(args, kwargs)
            leaves, treedef = _tree.flatten((dyn, dyn_kw))
        else:
            leaves, treedef = _tree.flatten(dyn)
        leaf_keys: list[tuple] = []
        differentiable = False
        for j, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                if x.requires_grad or _torch.is_functorch_wrapped(x):
                    differentiable = True
                leaf_keys.append((x.shape, x.dtype, x.device.type))   # (a Size is a tuple)
            else:
                if type(x) not in _PLAIN_STATIC:
                    _check_leaf(x, functools.partial(_dyn_path, args, nums, dyn_kw, j), self.name)
                leaf_keys.append(("static", type(x), x))   # 1, 1.0 and True are distinct
        amb = ambient()
        key: tuple = (treedef, tuple(leaf_keys), tuple((type(v), v) for v in static), nums, mesh,
                      amb)
        if static_kw is not None:     # (the dynamic ones are in the treedef)
            key = key + (("kwargs", tuple((k, type(v), v) for k, v in sorted(static_kw.items()))),)
        grad = None
        if differentiable:      # NOTE [pjit under autograd]: a program with a backward
            if any(_torch.is_vmapped(x) for x in leaves if isinstance(x, torch.Tensor)):
                raise TypeError(VMAP.format(name=self.name))
            enabled = torch.is_grad_enabled()
            grad = tuple(enabled and x.requires_grad for x in leaves if isinstance(x, torch.Tensor))
            if any(grad) or any(_torch.is_functorch_wrapped(x) for x in leaves
                                if isinstance(x, torch.Tensor)):
                key = key + (("grad", grad),)
            else:
                grad = None
        return Signature(mesh, leaves, treedef, static, nums, key, amb, static_kw, grad)

    def _split_kwargs(self, args, kwargs) -> tuple[dict, dict]:
        """(static, dynamic) keyword arguments, checked against the signature."""
        params = self._params
        if params is not None:
            for k in kwargs:
                if k in params.positional[:len(args)]:
                    raise TypeError(f"{self.name} got multiple values for argument {k!r} "
                                    f"(positional argument {params.positional.index(k)} and a "
                                    f"keyword).")
                if params.keywords is not None and k not in params.keywords:
                    raise TypeError(
                        f"{self.name} got an unexpected keyword argument {k!r}; the function "
                        f"takes ({', '.join(params.names)})."
                    )
        static = {k: v for k, v in kwargs.items() if k in self.static_argnames}
        for k, v in static.items():
            _check_static_arg(v, f"kwargs[{k!r}]", self.name, "static_argnames")
        dyn = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        return static, dyn

    def _static_argnums_for(self, nargs: int) -> tuple:
        return _argnums_for(self.static_argnums, nargs, self._params, self.name, "static_argnums")

    def leaf_specs(self, args: tuple, dyn: tuple, nums: tuple, dyn_kw: dict) -> list[tuple[str, Any]]:
        """(spec path, spec) for every dynamic leaf, positional args then keywords
        (NOTE [Keyword arguments])."""
        specs = self.in_specs
        if isinstance(specs, dict):                  # by parameter name
            pos = self._params.positional if self._params is not None else ()
            out = []
            for i, a in ((i, a) for i, a in enumerate(args) if i not in nums):
                if i >= len(pos):
                    raise TypeError(
                        f"{self.name}: in_specs is a dict, which names arguments by parameter "
                        f"name, but positional argument {i} has no name (it goes to *args); "
                        f"give in_specs as a tuple with one entry per positional argument.")
                out += _tree.broadcast_prefix(specs.get(pos[i]), a,
                                              f"{self.name} in_specs[{pos[i]!r}]")
            kw = {k: specs.get(k) for k in dyn_kw}
            labels = {k: f"{self.name} in_specs[{k!r}]" for k in dyn_kw}
        elif _tree.is_spec_leaf(specs):              # one spec for everything
            out = _tree.arg_specs(specs, dyn, self.name)
            kw = {k: specs for k in dyn_kw}
            labels = {k: f"{self.name} in_specs" for k in dyn_kw}
        else:                                        # one entry per positional parameter
            specs = tuple(specs) if isinstance(specs, (tuple, list)) else specs
            excluded = " (static_argnums excluded)" if nums else ""
            kw, labels = {}, {}
            if isinstance(specs, tuple) and len(specs) > len(dyn) and self._params is not None:
                # parameters after the call's positional args, passed by keyword
                names = [k for i, k in enumerate(self._params.positional) if i not in nums]
                if len(specs) <= len(names):
                    for j in range(len(dyn), len(specs)):
                        kw[names[j]], labels[names[j]] = specs[j], f"{self.name} in_specs[{j}]"
                    specs = specs[:len(dyn)]
            out = _tree.arg_specs(specs, dyn, self.name, excluded)
            for k in dyn_kw:
                if k not in kw:
                    kw[k] = None
                    labels[k] = f"{self.name} default P() for keyword arguments"
        for k in sorted(dyn_kw):                     # the flatten order of a dict
            out += _tree.broadcast_prefix(kw.get(k), dyn_kw[k], labels[k])
        return out


    def donated_leaves(self, args, nums, dyn_kw: dict, leaves: list) -> list[int]:
        """Indices of the tensor leaves that belong to donated arguments."""
        if not self.donate_argnums and not self.donate_argnames:
            return []
        donate = set(_argnums_for(self.donate_argnums, len(args), self._params, self.name,
                                  "donate_argnums"))
        owner = []
        for i, a in enumerate(args):
            if i not in nums:
                owner += [i in donate] * len(_tree.flatten(a)[0])
        for k in sorted(dyn_kw):                    # the flatten order of a dict
            owner += [k in self.donate_argnames] * len(_tree.flatten(dyn_kw[k])[0])
        return [j for j, (d, x) in enumerate(zip(owner, leaves)) if d and isinstance(x, torch.Tensor)]

    def flat_fn(self, sig: Signature, out_info: dict) -> Callable:
        """``fn`` over flat tensors: rebuilds the args (with the static leaves) and
        flattens the outputs, recording their structure and static leaves."""
        leaves, treedef = sig.leaves, sig.treedef
        statics = dict(zip(sig.static_argnums, sig.static_args))
        static_kw = sig.static_kwargs
        fn, name = self.fn, self.name

        def flat_fn(*tensors):
            it = iter(tensors)
            filled = [next(it) if isinstance(x, torch.Tensor) else x for x in leaves]
            tree = _tree.unflatten(treedef, filled)
            pos, kw = (tree, {}) if static_kw is None else (tree[0], {**static_kw, **tree[1]})
            dyn = iter(pos)
            n = len(statics) + len(pos)
            args = [statics[i] if i in statics else next(dyn) for i in range(n)]
            out = fn(*args, **kw)
            out_leaves, out_treedef = _tree.flatten(out)
            for k, v in enumerate(out_leaves):
                if not isinstance(v, _OUTPUT_LEAVES):
                    path = _tree.leaf_paths(out, "output")[k]
                    raise TypeError(_bad_output(name, path, v)) from None
            out_info["leaves"], out_info["treedef"] = out_leaves, out_treedef
            return [v for v in out_leaves if isinstance(v, torch.Tensor)]

        return flat_fn

    def out_leaf_specs(self, out_leaves, out_treedef, mesh) -> list:
        tensors = [v for v in out_leaves if isinstance(v, torch.Tensor)]
        if self.out_specs is UNSPECIFIED:
            return [None] * len(tensors)
        tree = _tree.unflatten(out_treedef, out_leaves)
        matched = _tree.broadcast_prefix(
            self.out_specs, tree, f"{self.name} out_specs",
            is_leaf=lambda x: _tree.is_spec_leaf(x) or x is UNSPECIFIED)
        paths = _tree.leaf_paths(tree, "output")
        specs: list = []
        for v, (spath, spec), opath in zip(out_leaves, matched, paths):
            if not isinstance(v, torch.Tensor):
                continue
            if spec is UNSPECIFIED:       # this output keeps its propagated layout
                specs.append(None)
                continue
            if spec is AUTO:              # the solver chooses (sharded/auto/)
                specs.append(AUTO)
                continue
            spec = P() if spec is None else spec
            check_spec(spec, v.shape, mesh, f"{spath} (for {opath})")
            specs.append(spec)
        return specs


def _hashable_tree(tree):
    leaves, treedef = _tree.flatten(tree)
    key = (treedef, tuple(leaves))
    hash(key)
    return key


@dataclass
class TensorInputs:
    """The tensor inputs of one call, as the program takes them."""

    specs: list            # per tensor input: its P
    placements: list       # ... its placements on the mesh
    metas: list            # ... the tensor (under torch.func: the one it wraps)
    paths: list            # ... its argument path (args[0]['w'])
    leaf_paths: list       # per dynamic leaf: its path
    dyn_kw: dict           # the call's dynamic keyword arguments


def tensor_inputs(arguments: Arguments, sig: Signature, args: tuple) -> TensorInputs:
    """Match the call's leaves to their in_specs and check each against its tensor."""
    mesh, nums = sig.mesh, sig.static_argnums
    dyn = tuple(a for i, a in enumerate(args) if i not in nums)
    dyn_kw = _tree.unflatten(sig.treedef, sig.leaves)[1] if sig.static_kwargs is not None else {}
    leaf_specs = arguments.leaf_specs(args, dyn, nums, dyn_kw)
    paths = _dyn_paths(args, nums, dyn_kw)
    out = TensorInputs([], [], [], [], paths, dyn_kw)
    auto: dict[str, tuple[bool, str, Any]] = {}      # AUTO spec path -> holds a tensor
    for x, (spath, spec), apath in zip(sig.leaves, leaf_specs, paths):
        if spec is AUTO:
            seen = auto.get(spath)
            auto[spath] = (bool(seen and seen[0]) or isinstance(x, torch.Tensor),
                           seen[1] if seen else apath, seen[2] if seen else x)
        if not isinstance(x, torch.Tensor):
            continue
        x = _torch.functorch_base(x)       # under torch.func.grad: the tensor it wraps
        if spec is AUTO:                   # laid out by the solver (sharded/auto/)
            check_on_mesh(x, mesh, apath, arguments.name)
            out.specs.append(AUTO)
            out.placements.append(None)
            out.metas.append(x)
            out.paths.append(apath)
            continue
        spec = P() if spec is None else spec
        check_spec(spec, x.shape, mesh, f"{spath} (for {apath})")
        check_on_mesh(x, mesh, apath, arguments.name, stage_slices=True)
        out.specs.append(spec)
        out.placements.append(to_placements(spec, mesh))
        out.metas.append(x)
        out.paths.append(apath)
    for spath, (has_tensor, apath, x) in auto.items():
        if not has_tensor:
            raise ValueError(
                f"{arguments.name}: {spath} is AUTO but covers {apath} = {x!r:.60} "
                f"({type(x).__name__}), which holds no tensor: AUTO lays out tensors. "
                f"Give None (or P()) there, or pass it as a static argument.")
    return out


def check_on_mesh(x, mesh, path: str, api: str, kind: str = "pjit", *,
                  stage_slices: bool = False) -> None:
    """A DTensor input must live on the program's mesh (``kind``: whose mesh, for the
    message: "pjit" or "shard_map"), or with ``stage_slices`` on one pipeline stage's
    slice of it (NOTE [Stage slices] in sharded/mesh.py)."""
    if isinstance(x, DTensor) and x.device_mesh is not mesh.device_mesh \
            and x.device_mesh != mesh.device_mesh:
        found = slice_of(x.device_mesh)
        if found is not None and found[0] is mesh:
            if stage_slices:
                return
            raise ValueError(
                f"{api}: {path} lives on pipeline stage {found[2]}'s ranks only (a DTensor "
                f"on the {found[1]!r}={found[2]} slice of {mesh}), which only a pipelined "
                f"step over {found[1]!r} takes; gather it first (sharded.gather(tree): the "
                f"whole tensor on every rank) to use it elsewhere.")
        raise ValueError(
            f"{api}: {path} is a DTensor on {x.device_mesh}, not on the {kind} mesh {mesh}; "
            f"gather it and shard it onto this mesh."
        )
