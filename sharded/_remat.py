"""Activation checkpointing (remat) in the manner of ``jax.checkpoint``.

``remat(fn, policy)`` marks the ops that ``fn`` adds to the traced program as a
region; after the trace (and after the random rewrite, so that a recomputed draw is
the same draw), ``rematerialize`` makes the backward compute again what the region's
policy does not save, from the region's inputs and saved values. docs/remat.md.

# NOTE [Remat regions in the traced program]
pjit traces one flat program: the forward, the backward that torch.func.grad (or the
joint trace) adds after it, the optimizer. ``remat(fn)`` called while pjit traces
records ``sharded::remat_enter`` of each tensor argument of ``fn`` before calling it
and ``sharded::remat_exit`` of each tensor output after, markers that carry the
region's number (and its policy's). They are ops, so they survive everything before
the rewrite (the retrace under functionalize keeps node order and ops, not node
metadata; they are registered as side-effectful so that no dead-code pass drops
them). They take detached values and nothing reads their results, so the program's
autograd graph, and the order in which it sums gradients, is the one without remat
(the gradients are bitwise equal). The region is every node between its first enter
and its last exit in program order (the ops ``fn`` ran), its outputs what the exits
take. A shard_map body's markers are in its region's graph; its vjp, traced from that
graph, has them too (``rematerialize_program`` rewrites both).

The rewrite (``rematerialize``), for each region: the region's values that nodes
after it read (the backward's residuals), other than its outputs and the values the
policy saves, are computed again just before the first of those readers, each from
the region's inputs, outputs and saved values, and those readers read the copies.
The originals then have only forward readers, and the generated code frees them
there. The markers and ``checkpoint_name`` nodes are removed. Before the random
rewrite (the joint program, which the partitioner splits before it), random ops are
saved instead: the forward and backward programs draw from separate counters.

# NOTE [Parameters are read again]
The region's parameters (the program inputs it reads) are read by its recomputation
and by its backward (from the recomputation to the last reader of a recomputed value)
through ``sharded::remat_barrier`` too, as new values. Where the mode shards them
(DataParallelMode "shard"), the backward then gathers them again, as FSDP2 does for a
checkpointed block, instead of keeping the forward's gathered copies alive until the
backward; replicated, the barrier is a copy of the block's parameters, made when its
backward starts and freed when it ends. The optimizer, after every backward, reads the
parameters themselves (a donated parameter's storage stays the one it updates).

# NOTE [Recomputed values stay recomputed]
A copy of a node is the same op on the same inputs, which CSE (the mode's passes,
inductor's) would merge back into the original, and inductor's scheduler may run an
op as soon as its inputs exist: it ran every block's recomputation right after the
forward, all of them alive at once, until the recomputation waited for the backward.
So each copy that reads no other copy reads one of its inputs (the smallest) through
``sharded::remat_barrier(x, token)``, an opaque copy of ``x``, and ``token`` is
``sharded::remat_token(v)``, a scalar made from ``v``, the last value computed before
the recomputation starts. No copy is then the same op on the same inputs as its
original, and none can run before the backward reaches it. What a barrier copies is
the smallest input of such a root copy: under nothing_saveable a small tensor (a
norm's weight, the random seed); under a policy that saves values inside the region
(dots_saveable), a root copy may read only a saved activation (gelu of a saved
matmul), and its barrier copies that activation once per backward: one activation's
bytes, transient, and a memcpy. (An aliasing barrier would avoid it; not done.) The
token is a scalar,
replicated, not ``v`` itself: DataParallelMode's batch analysis takes what reads the
batch for a batch value, and a parameter's barrier must stay state.
"""

from __future__ import annotations

import functools
import itertools
import operator
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Replicate

from sharded import _registry, _torch, _tree
from sharded._region import Region
from sharded._registry import META_PHASE
from sharded._trace_state import in_global_trace

aten = torch.ops.aten

__all__ = ["remat", "checkpoint_name", "Policy", "remat_policies"]


# ---------------------------------------------------------------------------
# Policies
# ---------------------------------------------------------------------------

# torchtitan's selective activation checkpointing saves these ops' outputs
# (torchtitan/distributed/activation_checkpoint.py, ``_save_list``), plus the other
# matmul forms that a traced linear can become here.
MATMUL_OPS = frozenset(op for op in (
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    getattr(aten, "_scaled_mm", None) and aten._scaled_mm.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    getattr(aten, "_scaled_dot_product_cudnn_attention", None)
    and aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_attention_math.default,
    getattr(aten, "_scaled_dot_product_fused_attention_overrideable", None)
    and aten._scaled_dot_product_fused_attention_overrideable.default,
    aten.max.default,
) if op)


@dataclass(frozen=True)
class Policy:
    """What a remat region saves for the backward (everything else is recomputed):
    the outputs of the ops in ``ops`` and the values named (``checkpoint_name``) in
    ``names``. ``description`` is how messages name it."""

    ops: frozenset = frozenset()
    names: frozenset = frozenset()
    description: str = "nothing_saveable"
    strict_names: bool = False      # every name must exist in the region

    def saves(self, node: fx.Node, names: Iterable[str]) -> bool:
        return node.target in self.ops or any(n in self.names for n in names)


class remat_policies:
    """Policies for ``sharded.remat`` (the names are jax.checkpoint_policies')."""

    #: save nothing: the backward recomputes the whole region (torch.utils.checkpoint)
    nothing_saveable = Policy()
    #: save the outputs of matmuls and attention (torchtitan's selective AC op list)
    dots_saveable = Policy(ops=MATMUL_OPS, description="dots_saveable")

    @staticmethod
    def save_only_these_names(*names: str) -> Policy:
        """Save only the values tagged ``checkpoint_name(x, name)`` with these names;
        each must name a value in every region that uses the policy."""
        bad = [n for n in names if not isinstance(n, str)]
        if not names or bad:
            raise TypeError(f"remat_policies.save_only_these_names expects one or more "
                            f"str names; got {names!r}.")
        return Policy(names=frozenset(names), strict_names=True,
                      description=f"save_only_these_names{tuple(names)!r}")

    @staticmethod
    def save_ops(*ops) -> Policy:
        """Save the outputs of these aten op overloads (``torch.ops.aten.mm.default``)."""
        bad = [op for op in ops if not isinstance(op, _torch.OpOverload)]
        if not ops or bad:
            raise TypeError(f"remat_policies.save_ops expects aten op overloads such as "
                            f"torch.ops.aten.mm.default; got {bad or ops!r}.")
        return Policy(ops=frozenset(ops), description=f"save_ops{tuple(map(str, ops))!r}")


# ---------------------------------------------------------------------------
# The markers
# ---------------------------------------------------------------------------

@torch.library.custom_op("sharded::remat_enter", mutates_args=())
def _enter(x: torch.Tensor, region: int) -> torch.Tensor:
    return x.clone()


@torch.library.custom_op("sharded::remat_exit", mutates_args=())
def _exit(x: torch.Tensor, region: int) -> torch.Tensor:
    return x.clone()


@torch.library.custom_op("sharded::checkpoint_name", mutates_args=())
def _name(x: torch.Tensor, name: str) -> torch.Tensor:
    return x.clone()


@torch.library.custom_op("sharded::remat_barrier", mutates_args=())
def _barrier(x: torch.Tensor, after: torch.Tensor | None = None) -> torch.Tensor:
    return x.clone()


@torch.library.custom_op("sharded::remat_token", mutates_args=())
def _token(after: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=after.dtype, device=after.device)


@_token.register_fake
def _(after):
    return torch.empty((), dtype=after.dtype, device=after.device)


def _identity_fake(x, *args):
    return torch.empty_like(x)


for _op in (_enter, _exit, _name, _barrier):
    _op.register_fake(_identity_fake)


ENTER_OP = torch.ops.sharded.remat_enter.default
EXIT_OP = torch.ops.sharded.remat_exit.default
NAME_OP = torch.ops.sharded.checkpoint_name.default
BARRIER_OP = torch.ops.sharded.remat_barrier.default
TOKEN_OP = torch.ops.sharded.remat_token.default
MARKERS = (ENTER_OP, EXIT_OP, NAME_OP)


class _Marker(torch.autograd.Function):
    """A marker, differentiable under torch.func: its gradient is the identity (and
    leaves nothing in the backward)."""

    @staticmethod
    def forward(x, op, arg):
        return op(x, arg)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def _mark(op, x: torch.Tensor, arg) -> torch.Tensor:
    return _Marker.apply(x, op, arg)


# The markers must stay in the graph until the rewrite reads them, where nothing reads
# an output (the primal outputs of a region's vjp): not dead code.
for _m in MARKERS:
    fx.node.has_side_effect(_m)

def _marker_vmap(op, info, in_dims, x, arg):
    """Under torch.func.vmap: the marker of the batched value."""
    return op(x, arg), in_dims[0]


# a shard_map region's graph is interpreted under torch.func for its vjp: the markers
# there are their differentiable calls
for _m in MARKERS:
    _registry.define(_m, autograd=functools.partial(_mark, _m),
                     vmap=functools.partial(_marker_vmap, _m))


def _local(x):
    return x.to_local() if isinstance(x, DTensor) else x


def _expand_barrier(ex, node, args, kwargs):
    """The barrier in a rank's program: on this rank's block, laid out as its input."""
    x, after = (*args, None)[:2]
    if not isinstance(x, DTensor):
        return BARRIER_OP(x, _local(after))
    local = BARRIER_OP(x.to_local(), _local(after))
    return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False,
                              shape=x.shape, stride=x.stride())


def _expand_token(ex, node, args, kwargs):
    """The token in a rank's program: from this rank's block, replicated (it is a
    dependency, not a value)."""
    after, = args
    local = TOKEN_OP(_local(after))
    if not isinstance(after, DTensor):
        return local
    return DTensor.from_local(local, after.device_mesh, [Replicate()] * after.device_mesh.ndim,
                              run_check=False, shape=torch.Size(()), stride=())


_registry.define(BARRIER_OP, expand=_expand_barrier)
_registry.define(TOKEN_OP, expand=_expand_token)

# the markers carry the region's number (a custom op's arguments are plain values)
# (a region's number is (n << _POLICY_BITS) | its policy's index in the table below:
# the table has one entry per distinct policy, however often programs are traced)
_POLICY_BITS = 20
_POLICIES: list[Policy] = []
_POLICY_INDEX: dict[Policy, int] = {}
_IDS = itertools.count(1)


def _region_number(policy: Policy) -> int:
    k = _POLICY_INDEX.get(policy)
    if k is None:
        if len(_POLICIES) >= 1 << _POLICY_BITS:
            raise RuntimeError("sharded.remat: too many distinct policies in one process.")
        k = _POLICY_INDEX[policy] = len(_POLICIES)
        _POLICIES.append(policy)
    return (next(_IDS) << _POLICY_BITS) | k


def _policy_of(region: int) -> Policy:
    return _POLICIES[region & ((1 << _POLICY_BITS) - 1)]


# ---------------------------------------------------------------------------
# The API
# ---------------------------------------------------------------------------

def checkpoint_name(x: torch.Tensor, name: str) -> torch.Tensor:
    """``x``, named ``name`` for a remat policy (``remat_policies.save_only_these_names``).
    An identity: outside pjit's trace it returns ``x`` itself."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"sharded.checkpoint_name expects a non-empty str name; got {name!r}.")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"sharded.checkpoint_name({name!r}) expects a tensor; got "
                        f"{type(x).__name__}.")
    if not in_global_trace():
        return x
    NAME_OP(x.detach(), name)
    return x


def remat(fn: Callable | None = None, policy: Policy | None = None) -> Callable:
    """``fn`` whose intermediate values the backward computes again instead of keeping
    them from the forward, except those ``policy`` saves (default: none;
    ``remat_policies``). Like ``jax.checkpoint``: the values and gradients are those of
    ``fn``; inside a pjit'd function, the program's backward recomputes the region
    (its random draws are the same draws). Outside pjit's trace, ``fn`` runs as is.
    Usable as a decorator, ``@remat`` or ``@remat(policy=...)``. Arguments that are
    not tensors are passed through as they are (jax.checkpoint's static_argnums is not
    needed: the function is traced once)."""
    if fn is None:
        return functools.partial(remat, policy=policy)
    if not callable(fn):
        raise TypeError(f"sharded.remat expects a callable; got {type(fn).__name__}.")
    if policy is None:
        policy = remat_policies.nothing_saveable
    if not isinstance(policy, Policy):
        raise TypeError(
            f"sharded.remat: policy must be one of sharded.remat_policies "
            f"(nothing_saveable, dots_saveable, save_only_these_names(...), "
            f"save_ops(...)) or None; got {policy!r}.")

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if not in_global_trace():
            return fn(*args, **kwargs)
        return call_in_region(fn, policy, args, kwargs)

    return wrapped


def call_in_region(fn: Callable, policy: Policy, args: tuple, kwargs: dict):
    """``fn(*args, **kwargs)`` as a remat region of the program being traced."""
    region = _region_number(policy)
    leaves, treedef = _tree.flatten((args, kwargs))
    if not any(isinstance(x, torch.Tensor) for x in leaves):
        raise TypeError(
            f"sharded.remat: the function {getattr(fn, '__name__', fn)!r} takes no tensor "
            f"arguments, so the region has no inputs to recompute from. Pass the "
            f"activations it computes from as arguments (parameters may stay closed over).")
    # the markers take detached values and their results are not used: the program's
    # autograd graph (and so the order its gradients are summed in) is the one
    # without remat (NOTE [Remat regions in the traced program])
    for x in leaves:
        if isinstance(x, torch.Tensor):
            ENTER_OP(x.detach(), region)
    out = fn(*args, **kwargs)
    for x in _tree.flatten(out)[0]:
        if isinstance(x, torch.Tensor):
            EXIT_OP(x.detach(), region)
    return out


def torch_checkpoint(function, *args, use_reentrant=None, context_fn=None,
                     determinism_check=None, debug=None, early_stop=None,
                     preserve_rng_state=True, **kwargs):
    """What ``torch.utils.checkpoint.checkpoint`` does while pjit traces: a remat
    region that saves nothing (NOTE [torch.utils.checkpoint while tracing] in
    sharded/_torch.py)."""
    if not in_global_trace():
        # another thread's call while this one traces (the redirect is process-wide):
        # torch's own checkpoint
        kw = {k: v for k, v in (("context_fn", context_fn), ("determinism_check", determinism_check),
                                ("debug", debug), ("early_stop", early_stop)) if v is not None}
        return _torch.torch_checkpoint_itself()(function, *args, use_reentrant=use_reentrant,
                                                preserve_rng_state=preserve_rng_state, **kw, **kwargs)
    if context_fn is not None and not _torch.is_noop_checkpoint_context(context_fn):
        raise NotImplementedError(
            "torch.utils.checkpoint.checkpoint with a context_fn (selective activation "
            "checkpointing) inside a pjit'd function: sharded cannot read torch's policy "
            "function from the traced program. Use sharded.remat(fn, policy=...) with "
            "sharded.remat_policies (dots_saveable is torchtitan's op list) instead.")
    return call_in_region(function, remat_policies.nothing_saveable, args, kwargs)


# ---------------------------------------------------------------------------
# The rewrite
# ---------------------------------------------------------------------------

@dataclass
class _Region:
    number: int
    start: int                      # position of its first enter marker
    end: int                        # position of its last exit marker
    outputs: set = field(default_factory=set)
    names: dict = field(default_factory=dict)    # node -> [names]


# ops whose output is an alias of (a view of) their first input: recomputing one from
# values that are kept costs nothing, so it is used as it is
_VIEW_OPS = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default,
    aten.transpose.int, aten.permute.default, aten.expand.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.alias.default, aten.slice.Tensor,
    aten.select.int, aten.as_strided.default,
}) | frozenset(op for op in (getattr(torch.ops.sharded, "pvary", None),) if op is not None
               for op in (op.default,))     # a shard_map body's varying-type identity


def rematerialize_program(gm: fx.GraphModule, *, save_random: bool = False) -> int:
    """``rematerialize`` on ``gm`` and on the graphs of the shard_map regions it owns
    (a region's vjp is traced from its body: it recomputes the body's forward, which
    the passes' CSE merges with the forward's, except the copies made here)."""
    done = 0
    for m in gm.modules():
        if isinstance(m, Region) and has_regions(m.graph_module):
            done += rematerialize(m.graph_module, save_random=save_random)
            m.graph_module.graph.eliminate_dead_code()
            m.graph_module.recompile()
    return done + rematerialize(gm, save_random=save_random)


_DETACH = (aten.detach.default, aten.alias.default)


def _source(n):
    """The value a marker's detached input is."""
    while isinstance(n, fx.Node) and n.op == "call_function" and n.target in _DETACH:
        n = n.args[0]
    return n


def has_regions(gm: fx.GraphModule) -> bool:
    return any(n.op == "call_function" and n.target in MARKERS for n in gm.graph.nodes)


def rematerialize(gm: fx.GraphModule, *, save_random: bool = False) -> int:
    """NOTE [Remat regions in the traced program]: recompute in the backward what each
    region's policy does not save; remove the markers. ``save_random``: keep random
    ops' outputs (before the random rewrite, a copy of a random op would draw again).
    Returns the number of nodes recomputed."""
    g = gm.graph
    if not has_regions(gm):
        return 0
    order = {n: i for i, n in enumerate(g.nodes)}
    regions: dict[int, _Region] = {}
    named: list[tuple[fx.Node, fx.Node, str]] = []      # (name node, value, name)
    for n in g.nodes:
        if n.op != "call_function":
            continue
        if n.target is ENTER_OP or n.target is EXIT_OP:
            k = n.args[1]
            r = regions.setdefault(k, _Region(k, order[n], order[n]))
            r.start, r.end = min(r.start, order[n]), max(r.end, order[n])
        elif n.target is NAME_OP:
            named.append((n, _source(n.args[0]), n.args[1]))
    for n in g.nodes:
        if n.op == "call_function" and n.target is EXIT_OP:
            regions[n.args[1]].outputs.add(_source(n.args[0]))
    # nested regions: the outer one decides (its policy covers the inner's ops)
    spans = sorted(regions.values(), key=lambda r: (r.start, -r.end))
    top: list[_Region] = []
    for r in spans:
        if top and r.start < top[-1].end:
            continue
        top.append(r)
    for node, value, name in named:
        for r in top:
            if r.start < order[node] < r.end:
                r.names.setdefault(value, []).append(name)
    for r in top:
        policy = _policy_of(r.number)
        if policy.strict_names:
            found = {nm for names in r.names.values() for nm in names}
            missing = sorted(policy.names - found)
            if missing:
                raise ValueError(
                    f"sharded.remat: the policy {policy.description} names {missing}, but "
                    f"no value in the region is tagged with "
                    f"{'that name' if len(missing) == 1 else 'those names'} (names in the "
                    f"region: {sorted(found) or 'none'}). Tag the value inside the "
                    f"rematerialized function with sharded.checkpoint_name(x, "
                    f"{missing[0]!r}), or drop the name from the policy.")
    # the markers and names are read: remove them (and the detaches they took)
    for n in list(g.nodes):
        if n.op == "call_function" and n.target in MARKERS:
            n.replace_all_uses_with(n.args[0])
            inp = n.args[0]
            g.erase_node(n)
            while isinstance(inp, fx.Node) and inp.target in _DETACH and not inp.users:
                nxt = inp.args[0]
                g.erase_node(inp)
                inp = nxt
    done = 0
    for r in top:
        policy = _policy_of(r.number)
        done += _recompute(g, r, policy, order, save_random)
    g.lint()
    gm.recompile()
    return done


def _recompute(g: fx.Graph, r: _Region, policy: Policy, order: dict, save_random: bool) -> int:
    inside = [n for n in g.nodes if n in order and r.start < order[n] < r.end
              and n.op == "call_function"]
    members = set(inside)
    saved = set(r.outputs)
    for n in inside:
        if policy.saves(n, r.names.get(n, ())) or not _recomputable(n, save_random):
            saved.add(n)
    for n in inside:       # a saved op's tuple elements are saved with it
        if n.target is operator.getitem and n.args[0] in saved:
            saved.add(n)
    later = {n: [u for u in n.users if u not in members and order.get(u, len(order)) > r.end]
             for n in inside if n not in saved}
    later = {n: us for n, us in later.items() if us}
    if not later:
        return 0
    readers = {u for us in later.values() for u in us}
    for u in readers:
        _sink_view(u)
    pos = {n: i for i, n in enumerate(g.nodes)}
    at = min(readers, key=pos.__getitem__)
    copies: dict[fx.Node, fx.Node] = {}
    barriers: dict[fx.Node, fx.Node] = {}
    phase = at.meta.get(META_PHASE)
    token = _token_before(g, at, r.end, order, phase)
    # the program inputs the region reads (its parameters) and the region's views of
    # them: read again, through a barrier, by the recomputation and by the region's
    # backward (NOTE [Parameters are read again])
    inputs = {a for n in inside for a in n.all_input_nodes
              if a.op == "placeholder" and isinstance(a.meta.get("val"), torch.Tensor)}
    rereads: dict[fx.Node, fx.Node] = {}

    def of_input(n: fx.Node) -> bool:
        if n in inputs:
            return True
        return (n in members and n not in saved and n.target in _VIEW_OPS
                and all(of_input(a) for a in n.all_input_nodes))

    def reread(n: fx.Node) -> fx.Node:
        if n in rereads:
            return rereads[n]
        if n in inputs:
            with g.inserting_before(at):
                b = g.call_function(BARRIER_OP, (n, token))
            b.meta["val"] = n.meta["val"]
        else:
            for a in n.all_input_nodes:
                reread(a)
            with g.inserting_before(at):
                b = g.node_copy(n, lambda a: rereads.get(a, a))
            b.meta = dict(n.meta)
        if phase is not None:
            b.meta[META_PHASE] = phase
        rereads[n] = b
        return b

    def kept(n) -> bool:
        if not isinstance(n, fx.Node) or n not in members or n in saved:
            return True
        if n.target in _VIEW_OPS and all(kept(a) for a in n.all_input_nodes):
            return True         # a view of kept values: kept itself
        return not any(isinstance(a, fx.Node) for a in n.all_input_nodes)   # a constant

    def copy(n: fx.Node) -> fx.Node:
        if of_input(n):
            return reread(n)
        if kept(n):
            return n
        if n in copies:
            return copies[n]
        for a in n.all_input_nodes:
            copy(a)
        with g.inserting_before(at):
            c = g.node_copy(n, lambda a: copies.get(a, rereads.get(a, a)))
        c.meta = dict(n.meta)
        if phase is not None:
            c.meta[META_PHASE] = phase
        fresh = set(copies.values()) | set(barriers.values()) | set(rereads.values())
        if not any(a in fresh for a in c.all_input_nodes):
            _through_barrier(g, c, barriers, phase, token)
        copies[n] = c
        return c

    for n, users in later.items():
        c = copy(n)
        for u in users:
            u.replace_input_with(n, c)
    # the region's backward (from the recomputation to the last reader of a recomputed
    # value) reads its parameters again too
    pos = {n: i for i, n in enumerate(g.nodes)}
    made = set(copies.values()) | set(barriers.values()) | set(rereads.values())
    first = pos[at]
    last = max((pos[u] for c in copies.values() for u in c.users), default=first)
    for n in [a for a in inputs] + [m for m in inside if of_input(m)]:
        users = [u for u in n.users if u not in made and first <= pos.get(u, -1) <= last]
        if users:
            b = reread(n)
            for u in users:
                u.replace_input_with(n, b)
    return len(copies)


def _token_before(g: fx.Graph, at: fx.Node, end: int, order: dict, phase):
    """``sharded::remat_token`` of the tensor computed last before ``at`` and after the
    region (NOTE [Recomputed values stay recomputed]), or None if there is none."""
    n = at.prev
    while n.op != "root" and (n not in order or order[n] > end):
        if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor) \
                and n.meta["val"].numel() > 0:
            with g.inserting_before(at):
                token = g.call_function(TOKEN_OP, (n,))
            val = n.meta["val"]
            token.meta["val"] = val.new_empty(())
            if phase is not None:
                token.meta[META_PHASE] = phase
            return token
        n = n.prev
    return None


def _through_barrier(g: fx.Graph, c: fx.Node, barriers: dict, phase, token) -> None:
    """NOTE [Recomputed values stay recomputed]: ``c`` reads its smallest tensor input
    through a barrier."""
    tensors = [a for a in c.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    if not tensors:
        return
    x = min(tensors, key=lambda a: a.meta["val"].numel())
    b = barriers.get(x)
    if b is None:
        with g.inserting_before(c):
            b = g.call_function(BARRIER_OP, (x, token))
        b.meta["val"] = x.meta["val"]
        if phase is not None:
            b.meta[META_PHASE] = phase
        barriers[x] = b
    c.replace_input_with(x, b)


# NOTE [A view waits for its reader]
# The recomputation goes before the first later reader of a value it recomputes. A view
# of such a value can sit far ahead of what reads it: the joint program copies the
# forward's views to the start of its backward (NOTE [The joint program] in _trace.py),
# and a view of a 3-D activation (F.linear's reshape) read by the backward would pull
# every region's recomputation to the backward's first node, all alive at once (the
# backward's peak rose above the program without remat). A view costs nothing and
# reads nothing else, so it is moved down to just before its first reader first (its
# own view readers first), and the recomputation goes before the first real reader.
def _sink_view(u: fx.Node) -> None:
    """NOTE [A view waits for its reader]."""
    if u.op != "call_function" or u.target not in _VIEW_OPS or not u.users:
        return
    for v in list(u.users):
        _sink_view(v)
    users = set(u.users)
    first = u.next
    while first not in users:
        first = first.next
    if u.next is not first:
        first.prepend(u)


def _recomputable(n: fx.Node, save_random: bool) -> bool:
    t = n.target
    if isinstance(t, _torch.OpOverload):
        if _torch.is_mutating_op(t):
            return False
        if save_random and torch.Tag.nondeterministic_seeded in t.tags:
            return False
        return True
    return t is operator.getitem

