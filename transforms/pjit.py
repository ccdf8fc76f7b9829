"""pjit: trace a pure function once per input signature, partition it for this rank,
and run the per-rank program on DTensors.

Pipeline (one direction): check -> key -> trace -> partition -> passes -> run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from sharded import _torch, _tree, random as srandom, sync
from sharded.random.rewrite import rewrite_random_ops
from sharded.mesh import Mesh, current_mesh
from sharded.modes import DTensorExpandMode, ParallelMode
from sharded.passes import fingerprint
from sharded.spec import P, check_spec, from_placements, local_slice, to_placements
from transforms._trace import in_global_trace, mutated_inputs, trace_global
from transforms.lowered import Lowered


class _Unspecified:
    def __repr__(self):
        return "UNSPECIFIED"


UNSPECIFIED = _Unspecified()


def pjit(
    fn: Callable | None = None,
    /,
    *,
    in_specs,
    out_specs=UNSPECIFIED,
    mesh: Mesh | None = None,
    mode: ParallelMode | None = None,
    static_argnums: int | Sequence[int] = (),
    donate_argnums: int | Sequence[int] = (),
):
    """Partition ``fn`` over ``mesh`` and return a jitted callable.

    - ``in_specs``: a pytree prefix of the positional arguments (static ones left
      out), with ``P`` or ``None`` (replicated) leaves; a single ``P`` covers all.
      DTensor inputs are redistributed if their layout differs; plain tensors are taken
      as the same global value on every rank and sliced locally.
    - ``out_specs``: a pytree prefix of the outputs; ``UNSPECIFIED`` keeps the layout
      that propagation gives (pending reductions are reduced to replicated).
    - ``static_argnums``: positional args passed as Python values; each distinct
      value traces a new program. Non-tensor leaves of the other args are static too.
    - ``donate_argnums``: accepted for JAX compatibility; buffers are not reused yet.

    The function is traced once per input signature (tree structure, shapes, dtypes,
    static values, mesh, mode) and cached.
    """
    if fn is None:
        return functools.partial(
            pjit, in_specs=in_specs, out_specs=out_specs, mesh=mesh, mode=mode,
            static_argnums=static_argnums, donate_argnums=donate_argnums,
        )
    return Pjit(fn, in_specs, out_specs, mesh, mode, static_argnums)


@dataclass
class _Signature:
    mesh: Mesh
    leaves: list                 # flat leaves of the dynamic args
    treedef: Any
    static_args: tuple
    key: tuple


@dataclass
class Compiled:
    """One traced and partitioned program (a cache entry). ``run`` is the per-call
    path: everything it needs is planned at compile time."""

    global_graph: fx.GraphModule
    local_graph: fx.GraphModule
    runner: Any                          # runs the local graph (it, or a compiled form)
    mesh: Mesh
    in_plan: list                        # per dynamic leaf: placements, or None (static)
    in_specs: list[P]                    # per tensor input (for Lowered)
    out_treedef: Any
    out_plan: list                       # per output leaf: ("static", value) or ("dtensor", spec)
    out_placements: list                 # per tensor output (for Lowered)
    layouts: dict | None = None          # the mode's report of the layouts it chose
    n_draws: int = 0                     # random draws per call (counter-based RNG)
    rng_device: Any = None
    digest: str = ""
    signature_lines: list = field(default_factory=list)
    agreed: bool = False                 # ranks compared fingerprints (first call)

    def run(self, leaves: list) -> Any:
        dm = self.mesh.device_mesh
        locals_ = []
        for leaf, pl in zip(leaves, self.in_plan):
            if pl is None:
                continue
            if isinstance(leaf, DTensor):
                if leaf.device_mesh is not dm and leaf.device_mesh != dm:
                    raise ValueError(
                        f"a DTensor input lives on {leaf.device_mesh}, not on the pjit mesh "
                        f"{self.mesh}; gather it and shard it onto this mesh."
                    )
                if leaf.placements != pl:
                    leaf = leaf.redistribute(dm, pl)
                # the program was traced on contiguous shards (views inside it assume so)
                locals_.append(_torch.local_tensor(leaf).detach().contiguous())
            else:
                locals_.append(local_slice(leaf.detach(), pl, self.mesh))
        if self.n_draws:
            locals_.extend(srandom._take(self.n_draws, self.rng_device))
        outs = iter(self.runner(*locals_))
        flat = [v if kind == "static" else _torch.make_dtensor(next(outs), v)
                for kind, v in self.out_plan]
        return _tree.unflatten(self.out_treedef, flat)


class Pjit:
    """The callable that pjit returns. ``.lower(*args)`` shows the program."""

    def __init__(self, fn, in_specs, out_specs, mesh, mode, static_argnums):
        self.fn = fn
        self.in_specs = in_specs
        self.out_specs = out_specs
        self.mesh = mesh
        self.mode = mode if mode is not None else DTensorExpandMode()
        if not isinstance(self.mode, ParallelMode):
            raise TypeError(f"pjit mode must be a sharded.modes.ParallelMode; got {self.mode!r}.")
        if isinstance(static_argnums, int):
            static_argnums = (static_argnums,)
        self.static_argnums = tuple(sorted(static_argnums))
        self.name = f"pjit({getattr(fn, '__name__', type(fn).__name__)})"
        self._cache: dict[tuple, Compiled] = {}
        self._mode_key = self.mode.cache_key()
        self.trace_count = 0
        # Name and docs only: a __wrapped__ attribute would let torch.func (and
        # inspect) call the raw function, bypassing this wrapper.
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__doc__ = getattr(fn, "__doc__", None)

    # -- API ----------------------------------------------------------------
    def __call__(self, *args):
        if in_global_trace():
            raise NotImplementedError(
                f"{self.name} was called inside another pjit-traced function; nested "
                f"pjit is not supported. Call the inner function directly (use "
                f"with_sharding_constraint for the layouts it imposed)."
            )
        sig = self._signature(args)
        entry = self._lookup(sig)
        if entry is None or not entry.agreed:
            try:
                entry = entry or self._compile(sig, args)
                outcome = (entry.digest, entry.signature_lines)
            except Exception as e:  # noqa: BLE001 - every rank must hear about it
                outcome = e
            sync.agree(sig.mesh, self.name, outcome)
            entry.agreed = True
            self._cache[sig.key] = entry
        if entry.n_draws and srandom.get_rng_state()["seed"] is None:
            srandom._agree_on_seed(sig.mesh)   # first use, or after set_rng_state(seed=None)
        return entry.run(sig.leaves)

    def lower(self, *args) -> Lowered:
        """Trace and partition for ``args`` without running (no communication)."""
        sig = self._signature(args)
        entry = self._lookup(sig)
        if entry is None:
            entry = self._cache[sig.key] = self._compile(sig, args)
        return Lowered(entry, self.name)

    # -- Checks and cache key ------------------------------------------------
    def _signature(self, args) -> _Signature:
        mesh = current_mesh(self.mesh, self.name)
        for i in self.static_argnums:
            if i >= len(args):
                raise ValueError(
                    f"{self.name}: static_argnums has {i} but the call has {len(args)} "
                    f"positional args."
                )
        static = tuple(args[i] for i in self.static_argnums)
        dyn = tuple(a for i, a in enumerate(args) if i not in self.static_argnums)
        leaves, treedef = _tree.flatten(dyn)
        leaf_keys: list[tuple] = []
        for x in leaves:
            if isinstance(x, torch.Tensor) and _torch.is_functorch_wrapped(x):
                raise TypeError(
                    f"{self.name} was called inside a torch.func transform (grad, vmap, "
                    f"...); a pjit/shard_map call is not differentiable from outside. Put "
                    f"the transform inside the function instead: "
                    f"pjit(torch.func.grad(loss), ...)."
                )
            if isinstance(x, torch.Tensor):
                leaf_keys.append((tuple(x.shape), x.dtype, x.device.type))
            else:
                leaf_keys.append(("static", type(x), x))   # 1, 1.0 and True are distinct
        key = (treedef, tuple(leaf_keys), tuple((type(v), v) for v in static), id(mesh),
               self._mode_key)
        return _Signature(mesh, leaves, treedef, static, key)

    def _lookup(self, sig: _Signature) -> Compiled | None:
        try:
            return self._cache.get(sig.key)
        except TypeError:
            raise TypeError(
                f"{self.name}: non-tensor arguments are static and must be hashable; "
                f"got an unhashable one in {sig.key[1]!r:.200}. Make it a tensor or a tuple."
            ) from None

    def _arg_paths(self, args) -> list[str]:
        paths = []
        for i, a in enumerate(args):
            if i not in self.static_argnums:
                paths.extend(_tree.leaf_paths(a, f"args[{i}]"))
        return paths

    def _leaf_specs(self, dyn: tuple) -> list[tuple[str, Any]]:
        excluded = " (static_argnums excluded)" if self.static_argnums else ""
        return _tree.arg_specs(self.in_specs, dyn, self.name, excluded)

    # -- Trace, partition, passes ---------------------------------------------
    def _compile(self, sig: _Signature, args) -> Compiled:
        mesh = sig.mesh
        dyn = tuple(a for i, a in enumerate(args) if i not in self.static_argnums)
        leaf_specs = self._leaf_specs(dyn)
        paths = self._arg_paths(args)
        tensor_leaf = [isinstance(x, torch.Tensor) for x in sig.leaves]

        in_specs, in_placements, metas, tensor_paths = [], [], [], []
        for x, (spath, spec), apath in zip(sig.leaves, leaf_specs, paths):
            if not isinstance(x, torch.Tensor):
                continue
            spec = P() if spec is None else spec
            check_spec(spec, x.shape, mesh, f"{spath} (for {apath})")
            if isinstance(x, DTensor) and x.device_mesh != mesh.device_mesh:
                raise ValueError(
                    f"{self.name}: {apath} is a DTensor on {x.device_mesh}, not on the "
                    f"pjit mesh {mesh}; gather it and shard it onto this mesh."
                )
            in_specs.append(spec)
            in_placements.append(to_placements(spec, mesh))
            metas.append(x)
            tensor_paths.append(apath)

        out_info: dict[str, Any] = {}
        flat_fn = self._flat_fn(sig, out_info)
        self.trace_count += 1
        global_gm = trace_global(flat_fn, metas, self.name)
        mutated = mutated_inputs(global_gm)
        if mutated:
            raise ValueError(
                f"{self.name}: the function mutates its input {tensor_paths[mutated[0]]} "
                f"in place; pjit functions must be pure. Return the new value instead "
                f"(e.g. `w = w - lr * g` rather than `w.sub_(lr * g)`)."
            )

        out_leaves, out_treedef = out_info["leaves"], out_info["treedef"]
        out_specs = self._out_leaf_specs(out_leaves, out_treedef, mesh)
        n_draws = rewrite_random_ops(global_gm, self.name)
        rng_placements = [to_placements(P(), mesh)] * 2 if n_draws else []  # seed, offset
        for node, path in zip(global_gm.graph.find_nodes(op="placeholder"),
                              tensor_paths + ["rng seed", "rng offset"]):
            node.meta["sharded_path"] = path
        part = self.mode.partition(global_gm, in_placements + rng_placements, out_specs, mesh)
        local_gm = self.mode.transform_and_compile(part.graph, mesh)
        if part.in_placements is not None:       # the mode laid the inputs out itself
            in_placements = list(part.in_placements[:len(in_placements)])
            in_specs = [from_placements(pl, mesh, m.ndim) for pl, m in zip(in_placements, metas)]

        out_vals = [n for n in global_gm.graph.nodes if n.op == "output"][0].args[0]
        out_dt_specs = [
            _torch.build_dtensor_spec(mesh.device_mesh, pl, v.meta["val"].shape,
                                      v.meta["val"].stride(), v.meta["val"].dtype)
            for v, pl in zip(out_vals, part.out_placements)
        ]
        sig_lines = [f"input {p}: {tuple(m.shape)} {m.dtype} {s!r}"
                     for p, m, s in zip(tensor_paths, metas, in_specs)]
        sig_lines += [f"static args: {sig.static_args!r:.200}"]
        digest, lines = fingerprint(local_gm, mesh, extra=tuple(sig_lines))
        placements = iter(in_placements)
        in_plan = [next(placements) if t else None for t in tensor_leaf]
        dt_specs = iter(out_dt_specs)
        out_plan = [("static", v) if not isinstance(v, torch.Tensor) else ("dtensor", next(dt_specs))
                    for v in out_leaves]
        return Compiled(
            global_graph=global_gm, local_graph=local_gm, runner=self.mode.runner(local_gm),
            mesh=mesh, in_plan=in_plan, in_specs=in_specs, out_treedef=out_treedef,
            out_plan=out_plan, out_placements=part.out_placements, layouts=part.layouts,
            n_draws=n_draws,
            rng_device=_mesh_device(mesh) if n_draws else None, digest=digest,
            signature_lines=lines,
        )

    def _flat_fn(self, sig: _Signature, out_info: dict) -> Callable:
        """``fn`` over flat tensors: rebuilds the args (with the static leaves) and
        flattens the outputs, recording their structure and static leaves."""
        leaves, treedef = sig.leaves, sig.treedef
        statics = dict(zip(self.static_argnums, sig.static_args))
        fn = self.fn

        def flat_fn(*tensors):
            it = iter(tensors)
            filled = [next(it) if isinstance(x, torch.Tensor) else x for x in leaves]
            dyn = iter(_tree.unflatten(treedef, filled))
            n = len(statics) + treedef.num_children
            args = [statics[i] if i in statics else next(dyn) for i in range(n)]
            out = fn(*args)
            out_leaves, out_treedef = _tree.flatten(out)
            out_info["leaves"], out_info["treedef"] = out_leaves, out_treedef
            return [v for v in out_leaves if isinstance(v, torch.Tensor)]

        return flat_fn

    def _out_leaf_specs(self, out_leaves, out_treedef, mesh) -> list:
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
            spec = P() if spec is None else spec
            check_spec(spec, v.shape, mesh, f"{spath} (for {opath})")
            specs.append(spec)
        return specs


def _mesh_device(mesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)
