"""Tracing: make_fx of the user's function on fake global-shaped tensors,
functionalized. The result is the global graph: the single-device program, aten ops
only, with torch.func.grad / vmap / einops already resolved.

Tracing runs the user's Python once, on fake tensors: anything that function does to
state outside its arguments would happen during the trace and never again (or, for
captured tensors, once per trace pass and again per call). So the trace guards that
state (NOTE [State outside the arguments]), and a failure names the function, the
user's line and the input shapes (NOTE [Errors while tracing]).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import sysconfig
import traceback
import types
from typing import Callable, Sequence

import torch
import torch.fx as fx

from sharded import _region, _remat, _torch
from sharded._registry import META_PHASE
from sharded.errors import CapturedStateError, TracingError
from sharded.sync import add_note
from sharded._trace_state import global_trace as _global_trace, in_global_trace  # noqa: F401


class _QuietFakeTensorErrors(logging.Filter):
    """Drop the fake-tensor machinery's ERROR log of a failing op while pjit traces:
    the failure reaches the user as one exception (NOTE [Errors while tracing])."""

    def filter(self, record):
        return not (in_global_trace() and record.levelno >= logging.ERROR)


logging.getLogger(_torch.FAKE_TENSOR_LOGGER).addFilter(_QuietFakeTensorErrors())


def trace_global(flat_fn: Callable, metas: Sequence[torch.Tensor], api: str, *,
                 fn: Callable | None = None, inputs: Sequence[str] = (),
                 requires_grad: Sequence[bool] | None = None) -> fx.GraphModule:
    """Trace ``flat_fn`` (flat tensors in, flat tensors out) on fakes like ``metas``.
    ``fn`` is the user's function (for the state guard and error messages) and
    ``inputs`` describes each tensor input (``"args[0]['w']: float32[4, 8]"``).

    With ``requires_grad`` (one flag per input), the trace is the joint forward and
    backward program instead (NOTE [The joint program]): see ``JointInfo``, in
    ``gm.meta["joint"]``.

    # NOTE [Trace, then functionalize]
    The function is traced as is first: torch.func.grad/vmap and autograd.Functions
    (with_sharding_constraint, the collectives) resolve to aten ops. Only if that
    graph has in-place ops is it traced again under functionalize (views are kept:
    DTensor has rules for views but not for several ``*_copy`` ops). Functionalizing
    the user function directly would fail on autograd.Functions under grad ("NYI:
    Functionalize rule for custom_function_call").
    """
    fake_mode = _torch.new_fake_mode()

    def make_fakes() -> list:
        with fake_mode:
            # meta inputs (lowering without memory, e.g. for Mesh.abstract) trace as CPU
            # fakes, so that tensors the function makes on the default device match them
            return [torch.empty_strided(m.shape, m.stride(), dtype=m.dtype,
                                        device="cpu" if m.device.type == "meta" else m.device)
                    for m in metas]

    fakes = make_fakes()
    state = ModuleState(fn, api) if fn is not None else None

    def guarded(*tensors):
        with _NoCapturedMutation(api, state):
            return flat_fn(*tensors)

    joint = JointInfo() if requires_grad is not None else None
    traced = guarded if joint is None else _joint_fn(guarded, list(requires_grad), joint)
    try:
        with _region.region_scope() as regions:   # shard_map bodies, owned by the graph
            with _global_trace():
                try:
                    # stack traces: errors in later steps name the user's source line;
                    # libraries see an export-style trace (NOTE [Tracing as torch.export
                    # does] in sharded/_torch.py)
                    # torch.utils.checkpoint calls become remat regions (NOTE
                    # [torch.utils.checkpoint while tracing] in sharded/_torch.py)
                    # the trace's code is generated when read or run (NOTE [Code
                    # generated once] in sharded/_torch.py)
                    with _torch.user_stack_traces(), _torch.export_tracing_state(), \
                            _torch.torch_checkpoint_as(_remat.torch_checkpoint), \
                            _torch.lazy_graph_modules():
                        gm = _torch.trace_on_fakes(traced, fakes, fake_mode)
                finally:
                    if state is not None:
                        state.restore_and_check()
                # the function ran on ``fakes`` themselves (NOTE [Trace, then
                # functionalize]): an in-place op may have changed one (``x.t_()``)
                gm = _region.functionalized(gm, make_fakes)
        regions.attach(gm)
        if joint is not None:
            _finish_joint(gm, joint)
            gm.meta["joint"] = joint
        return gm
    except (_torch.DataDependentOutputException, _torch.DynamicOutputShapeException) as e:
        raise TracingError(
            f"{api}: the function's Python control flow or output shape depends on "
            f"tensor values ({e.func if hasattr(e, 'func') else e}: e.g. `if x.sum() > 0`, "
            f"x.item(), x.tolist(), x.nonzero()). The function is traced once with "
            f"abstract values; use torch.where for value-dependent choices, or pass the "
            f"value as a static argument (static_argnums)."
            + _called_at(traceback.extract_tb(e.__traceback__), fn)
        ) from None
    except Exception as e:  # noqa: BLE001 - re-raised with the user's line and inputs
        raise _with_context(e, api, inputs, fn) from None


# ---------------------------------------------------------------------------
# The joint program (pjit under autograd)
# ---------------------------------------------------------------------------

# NOTE [The joint program]
# A pjit'd function called on inputs that require grad (or under torch.func.grad,
# vjp, jacrev) needs a backward program too. It is traced once, with the forward,
# as AOTAutograd does: the function runs on fake inputs that require grad, then
# torch.autograd.grad of the outputs that require grad, against one cotangent
# per such output, is traced into the same graph. Autograd.Functions in the user's
# code (with_sharding_constraint, the plan layouts, shard_map regions) contribute
# their own backward rules, which a trace of the traced graph would lose.
# The cotangents must be graph inputs, but which outputs need one is only known
# once the forward has run; so each is traced as a ``sharded::pjit_cotangent`` op
# applied to its output and, after the trace, replaced by a placeholder
# ``tangents_<k>`` (the name torch's partitioner recognises). The first of those
# ops is also where the forward ends: nodes before it are tagged forward, nodes
# after backward (``meta["sharded_phase"]``), and ``sharded._torch.partition_joint``
# splits the graph there (forward outputs plus the values the backward needs; the
# backward from those values and the cotangents). ``detach`` nodes, identities in
# a functional program, are dropped first so that a value is not saved twice.

@torch.library.custom_op("sharded::pjit_cotangent", mutates_args=())
def _cotangent(like: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("sharded::pjit_cotangent is replaced by a graph input after tracing.")


@_cotangent.register_fake
def _(like):
    return torch.empty(like.shape, dtype=like.dtype, device=like.device)


COTANGENT_OP = torch.ops.sharded.pjit_cotangent.default


@dataclasses.dataclass
class JointInfo:
    """What the joint trace found: ``n_out`` forward outputs; ``diff_out[i]``: output
    ``i`` requires grad (gets a cotangent, in order); ``grad_in``: the inputs that get
    a gradient (indices into the inputs; an input that requires grad but does not
    affect any output gets None)."""

    n_out: int = 0
    diff_out: list = dataclasses.field(default_factory=list)
    grad_in: list = dataclasses.field(default_factory=list)


def _joint_fn(forward: Callable, requires_grad: list, info: JointInfo) -> Callable:
    def joint(*tensors):
        with torch.enable_grad():
            prims = [t.detach().requires_grad_() if r else t for t, r in zip(tensors, requires_grad)]
            outs = list(forward(*prims))
            diff = [isinstance(o, torch.Tensor) and o.requires_grad for o in outs]
            tangents = [COTANGENT_OP(o.detach()) for o, d in zip(outs, diff) if d]
            wrt = [i for i, r in enumerate(requires_grad) if r]
            grads: Sequence = [None] * len(wrt)
            if tangents and wrt:
                grads = torch.autograd.grad([o for o, d in zip(outs, diff) if d],
                                            [prims[i] for i in wrt], tangents, allow_unused=True)
        info.n_out, info.diff_out = len(outs), diff
        info.grad_in = [i for i, g in zip(wrt, grads) if g is not None]
        return outs + [g for g in grads if g is not None]

    return joint


def _finish_joint(gm: fx.GraphModule, info: JointInfo) -> None:
    """Cotangent ops -> ``tangents_<k>`` placeholders, phase tags, no detach nodes
    (NOTE [The joint program])."""
    g = gm.graph
    phase = "forward"
    last_input = None
    cotangents = []
    for n in g.nodes:
        if n.op == "placeholder":
            last_input = n
        if n.op == "call_function" and n.target is COTANGENT_OP:
            phase = "backward"
            cotangents.append(n)
        n.meta[META_PHASE] = phase
    for k, n in enumerate(cotangents):
        with g.inserting_after(last_input):
            ph = g.placeholder(f"tangents_{k + 1}")
        ph.meta["val"] = n.meta["val"]
        ph.meta[META_PHASE] = "backward"
        n.replace_all_uses_with(ph)
        g.erase_node(n)
        last_input = ph
    for n in list(g.nodes):
        if n.op == "call_function" and n.target is torch.ops.aten.detach.default:
            n.replace_all_uses_with(n.args[0])
            g.erase_node(n)
    _views_in_backward(g)
    g.eliminate_dead_code()
    gm.recompile()


# NOTE [Views are recomputed in the backward]
# A forward view (view, reshape, transpose, permute, expand, ...) that the backward
# reads is computed again in the backward from its base, so that the partitioner
# saves the base, not the view. A view costs nothing to recompute and shares its
# base's memory, so nothing is lost; what is won is the layout the residual crosses
# the forward/backward boundary in. Flattening ``[b, h, s, d]`` sharded over ("dp",
# "tp") on b and h to ``[b * h, s, d]`` gives a strided layout (DTensor's
# _StridedShard) that no P expresses, whose shards may differ in size from rank to
# rank, and that most sharding rules do not take; the base has a plain layout, and
# the view in the backward propagates as it would in one joint program (the one
# ``pjit(torch.func.grad(f))`` runs). Only chains of views of a contiguous value are
# recomputed: a saved value reaches the backward contiguous, and a view that relied on
# its base's strides (``view`` of the transpose of SDPA's output, which is laid out
# [b, s, h, d] in memory) would not apply there.

_VIEW_OPS = frozenset({
    torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
    torch.ops.aten.reshape.default, torch.ops.aten.t.default, torch.ops.aten.transpose.int,
    torch.ops.aten.permute.default, torch.ops.aten.expand.default,
    torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim, torch.ops.aten.squeeze.dims,
    torch.ops.aten.alias.default,
})


def _views_in_backward(g: fx.Graph) -> None:
    """NOTE [Views are recomputed in the backward]."""
    first_bw = next((n for n in g.nodes if n.op == "call_function"
                     and n.meta.get(META_PHASE) == "backward"), None)
    if first_bw is None:
        return
    copies: dict = {}
    for n in list(g.nodes):
        if n is first_bw:
            break
        if n.op != "call_function" or n.target not in _VIEW_OPS:
            continue
        base = n.args[0]
        if base not in copies:       # the root of a chain of views: it crosses the boundary
            val = base.meta.get("val") if isinstance(base, fx.Node) else None
            if not (isinstance(val, torch.Tensor) and val.is_contiguous()):
                continue             # (saved values reach the backward contiguous)
        bw_users = [u for u in n.users if u.op == "call_function"
                    and u.meta.get(META_PHASE) == "backward"]
        with g.inserting_before(first_bw):
            copy = g.node_copy(n, lambda a: copies.get(a, a))
        copy.meta = dict(n.meta)
        copy.meta[META_PHASE] = "backward"
        copies[n] = copy
        for u in bw_users:
            u.replace_input_with(n, copy)


# ---------------------------------------------------------------------------
# Errors while tracing
# ---------------------------------------------------------------------------

# NOTE [Errors while tracing]
# A shape bug in the user's function fails inside torch, on fake tensors, with
# torch's message and ~20 lines of ERROR log per rank from the fake-tensor machinery.
# The log is filtered while pjit traces (_QuietFakeTensorErrors), and the exception is
# raised again, same type, with a message that names the pjit, the user's line (the
# innermost frame of the traceback outside torch, this project, optree, einops and
# the standard library) and the global input shapes. An exception that the user's own
# code raised (its innermost frame is the user's) keeps its type, message and
# traceback and gets that context as a note; this project's own errors (already
# naming the API and the fix) pass through unchanged.

def _dir_of(module) -> str:
    return os.path.dirname(os.path.abspath(module.__file__)) + os.sep


_OWN_DIRS = (_dir_of(_torch), os.path.dirname(os.path.abspath(__file__)) + os.sep)
_LIB_DIRS = _OWN_DIRS + (_dir_of(torch),)
for _name in ("optree", "einops"):
    try:
        _LIB_DIRS += (_dir_of(__import__(_name)),)
    except Exception:  # noqa: BLE001 - not installed
        pass
_paths = sysconfig.get_paths()
_SITE_DIRS = tuple({os.path.abspath(_paths[k]) + os.sep for k in ("purelib", "platlib") if k in _paths})
_STDLIB_DIRS = tuple({os.path.abspath(_paths[k]) + os.sep for k in ("stdlib", "platstdlib") if k in _paths})


def _is_user_file(filename: str) -> bool:
    """Not torch, this project, optree, einops or the standard library."""
    if filename.startswith("<"):
        # <stdin> and notebook cells are the user's; <string> is usually code that a
        # library generated with exec (torch.func does)
        return filename.startswith(("<stdin>", "<ipython"))
    path = os.path.abspath(filename)
    if path.startswith(_LIB_DIRS):
        return False
    if path.startswith(_SITE_DIRS):
        return True
    return not path.startswith(_STDLIB_DIRS)


def user_frame(frames: Sequence[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The innermost frame of ``frames`` in a file of the user's code (else in code
    without a file, such as <stdin>)."""
    for real in (True, False):
        for f in reversed(frames):
            if _is_user_file(f.filename) and (f.filename.startswith("<") != real):
                return f
    return None


def _defined_at(fn) -> str:
    """Where the user's function is defined (through torch.func wrappers)."""
    try:
        inner = inspect.unwrap(fn)
        code = getattr(inner, "__code__", None) or getattr(type(inner).__call__, "__code__", None)
        return f"{code.co_filename}:{code.co_firstlineno} (where the function is defined)"
    except Exception:  # noqa: BLE001
        return ""


def _is_own_file(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_OWN_DIRS)


def where(frame: traceback.FrameSummary | None) -> str:
    if frame is None:
        return ""
    line = f"{frame.filename}:{frame.lineno} in {frame.name}"
    if frame.line:
        line += f": `{frame.line.strip()}`"
    return line


def _in_site_packages(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_SITE_DIRS)


def _called_at(frames: Sequence[traceback.FrameSummary], fn=None) -> str:
    """Where a data-dependent call was made: the innermost frame outside torch and this
    project, and, where that frame is an installed library's (transformers'), the
    innermost of the user's own code that led there."""
    at = user_frame(frames)
    if at is None:
        defined = _defined_at(fn) if fn is not None else ""
        return f"\n  in the function at {defined}" if defined else ""
    out = f"\n  at {where(at)}"
    if _in_site_packages(at.filename) and not at.filename.startswith("<"):
        own = next((f for f in reversed(frames) if _is_user_file(f.filename)
                    and not f.filename.startswith("<") and not _in_site_packages(f.filename)), None)
        if own is not None:
            out += f"\n  called from {where(own)}"
    return out


def _with_context(e: Exception, api: str, inputs: Sequence[str], fn=None) -> Exception:
    frames = traceback.extract_tb(e.__traceback__)
    raised_in = frames[-1].filename if frames else ""
    if isinstance(e, (TracingError, CapturedStateError)) or (raised_in and _is_own_file(raised_in)):
        return e.with_traceback(None) if isinstance(e, CapturedStateError) else e
    at = where(user_frame(frames)) or (_defined_at(fn) if fn is not None else "")
    shapes = ", ".join(inputs) if inputs else "no tensor inputs"
    if raised_in and _is_user_file(raised_in):        # the user's own raise: keep it
        add_note(e, f"(raised while {api} traced the function with inputs {shapes})")
        return e
    msg = (f"{api}: tracing the function failed: {type(e).__name__}: {e}\n"
           f"  at {at or '(no frame of your code on the stack)'}\n"
           f"  with inputs {shapes} (global shapes)")
    try:
        new = type(e)(msg)
        if str(new) != msg:
            raise TypeError
    except Exception:  # noqa: BLE001 - an exception type that takes other arguments
        new = TracingError(msg)
    return new


# ---------------------------------------------------------------------------
# State outside the arguments
# ---------------------------------------------------------------------------

# NOTE [State outside the arguments]
# make_fx runs the user's function on fake tensors, but a tensor the function closes
# over (a module buffer, a global) is real, and an in-place op on it would run for
# real during each trace pass and then again, as a graph constant, on every call:
# BatchNorm's running stats advanced 3 times per call that way, silently. Three guards:
# - _NoCapturedMutation (a dispatch mode, innermost while the function runs) raises
#   before any op writes into a tensor that is not a tracing tensor, naming the tensor
#   (``bn.running_mean``, found in the function's closure, globals and bound self),
#   the op, the user's line and the fix;
# - ModuleState snapshots the parameters and buffers of the modules the function can
#   reach, and after the trace puts back any the function replaced (an error: the
#   update would be lost);
# - plain attributes that the function set to a tracing tensor (llama2.c's
#   ``model.last_loss``) are replaced by a LeakedTracer, which explains itself when
#   used (reading the attribute inside the function still works).
# The pattern that works is functional: pass the state in and return its new value
# (for modules: torch.func.functional_call with the buffers as an argument, cloned
# inside the function, and returned; docs/concepts.md, "Module state").

class _NoCapturedMutation(_torch.dispatch_mode_base()):
    def __init__(self, api: str, state: "ModuleState | None"):
        super().__init__()
        self.api = api
        self.state = state

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in _torch.written_tensors(func, args, kwargs):
            if not _torch.is_tracing_tensor(t):
                raise self._error(func, t)
        return func(*args, **kwargs)

    def _error(self, func, t: torch.Tensor) -> CapturedStateError:
        name = self.state.name_of(t) if self.state is not None else None
        owner = self.state.owner_of(t) if self.state is not None else None
        stats = ""
        if owner is not None and getattr(owner, "track_running_stats", False):
            stats = (" To keep its statistics fixed instead, call model.eval() (or build it "
                     "with track_running_stats=False) before tracing.")
        what = f"{name} (shape {tuple(t.shape)}, {t.dtype})" if name else (
            f"a tensor of shape {tuple(t.shape)} ({t.dtype}) that it closes over")
        at = where(user_frame(traceback.extract_stack()))
        return CapturedStateError(
            f"{self.api}: the function changes {what} in place with {func}"
            f"{' at ' + at if at else ''}; that tensor is not an argument, so the change "
            f"would happen while tracing and then on every call, not as the function says. "
            f"pjit functions must be pure: pass the tensor in as an argument and return its "
            f"new value. For module buffers (BatchNorm's running stats), call the module "
            f"with torch.func.functional_call(model, (params, buffers), args), the buffers "
            f"an argument cloned inside the function, and return the buffers "
            f"(docs/concepts.md, 'Module state').{stats}"
        )


class LeakedTracer:
    """What an attribute that the traced function set to a tracing tensor holds
    afterwards (NOTE [State outside the arguments]): any use raises with the fix."""

    __slots__ = ("_message",)

    def __init__(self, message: str):
        object.__setattr__(self, "_message", message)

    def __repr__(self):
        return f"<LeakedTracer: {self._message}>"

    def _fail(self, *args, **kwargs):
        raise RuntimeError(self._message)

    def __getattr__(self, name):
        raise RuntimeError(self._message)

    __bool__ = __float__ = __int__ = __index__ = __len__ = __iter__ = __call__ = _fail
    __getitem__ = __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _fail
    __truediv__ = __rtruediv__ = __matmul__ = __rmatmul__ = __neg__ = __format__ = _fail
    __lt__ = __le__ = __gt__ = __ge__ = _fail

    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        for a in list(args) + list((kwargs or {}).values()):
            if isinstance(a, LeakedTracer):
                raise RuntimeError(a._message)
        raise RuntimeError("a LeakedTracer was used")


_BASE_MODULE_KEYS = frozenset(vars(torch.nn.Module()))


class ModuleState:
    """The modules and tensors the traced function can reach (its closure, the
    globals it names, its bound self, partial arguments; a few levels deep), with a
    snapshot of their parameters and buffers."""

    def __init__(self, fn: Callable, api: str, depth: int = 3):
        self.api = api
        self.modules: dict[int, tuple[str, torch.nn.Module]] = {}
        self.objects: dict[int, tuple[str, object]] = {}
        self.tensors: dict[int, str] = {}
        self._seen: set[int] = set()
        self._visit_callable(fn, getattr(fn, "__name__", "fn"), depth)
        self.snapshot = {
            key: (dict(m._parameters), dict(m._buffers)) for key, (_, m) in self.modules.items()
        }

    # -- discovery ---------------------------------------------------------------
    def _visit_callable(self, f, name: str, depth: int) -> None:
        if depth < 0 or id(f) in self._seen:
            return
        self._seen.add(id(f))
        if isinstance(f, functools.partial):
            self._visit_callable(f.func, name, depth)
            for i, a in enumerate(f.args):
                self._visit_value(a, f"{name}.args[{i}]", depth - 1)
            for k, a in (f.keywords or {}).items():
                self._visit_value(a, f"{name}.keywords[{k!r}]", depth - 1)
            return
        if inspect.ismethod(f):
            self._visit_value(f.__self__, "self", depth)
            self._visit_callable(f.__func__, name, depth)
            return
        if isinstance(f, torch.nn.Module):
            self._add_module(f, name)
            return
        code = getattr(f, "__code__", None)
        if code is None:
            if callable(f) and hasattr(f, "__dict__") and not isinstance(f, type):
                self._visit_value(f, name, depth)
            return
        for var, cell in zip(code.co_freevars, getattr(f, "__closure__", None) or ()):
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            self._visit_value(value, var, depth - 1)
        globs = getattr(f, "__globals__", {})
        for var in _names(code):
            if var in globs:
                self._visit_value(globs[var], var, depth - 1)

    def _visit_value(self, v, name: str, depth: int) -> None:
        if depth < 0 or isinstance(v, (types.ModuleType, type, str, bytes, int, float)) or v is None:
            return
        if isinstance(v, torch.Tensor):
            self.tensors.setdefault(id(v), name)
            return
        if isinstance(v, torch.nn.Module):
            self._add_module(v, name)
            return
        if isinstance(v, (types.FunctionType, functools.partial, types.MethodType)):
            self._visit_callable(v, name, depth)
            return
        if id(v) in self._seen:
            return
        self._seen.add(id(v))
        if isinstance(v, (list, tuple)) and len(v) <= 64:
            for i, x in enumerate(v):
                self._visit_value(x, f"{name}[{i}]", depth - 1)
        elif isinstance(v, dict) and len(v) <= 64:
            for k, x in v.items():
                self._visit_value(x, f"{name}[{k!r}]", depth - 1)
        elif hasattr(v, "__dict__") and not callable(v) or dataclasses.is_dataclass(v):
            attrs = getattr(v, "__dict__", None)
            if isinstance(attrs, dict) and len(attrs) <= 64:
                self.objects.setdefault(id(v), (name, v))
                for k, x in attrs.items():
                    self._visit_value(x, f"{name}.{k}", depth - 1)

    def _add_module(self, m: torch.nn.Module, name: str) -> None:
        for sub_name, sub in m.named_modules():
            key = id(sub)
            if key not in self.modules:
                self.modules[key] = (f"{name}.{sub_name}" if sub_name else name, sub)

    # -- queries -----------------------------------------------------------------
    def owner_of(self, t: torch.Tensor) -> torch.nn.Module | None:
        for _, m in self.modules.values():
            if any(v is t for v in m._buffers.values()):
                return m
        return None

    def name_of(self, t: torch.Tensor) -> str | None:
        for mname, m in self.modules.values():
            for kind in (m._parameters, m._buffers):
                for k, v in kind.items():
                    if v is t:
                        return f"{mname}.{k}"
        return self.tensors.get(id(t))

    def restore_and_check(self) -> None:
        """Put back replaced parameters/buffers (then raise); replace attributes that
        hold tracing tensors by LeakedTracers."""
        replaced = []
        for key, (mname, m) in self.modules.items():
            params, buffers = self.snapshot.get(key, ({}, {}))
            for kind, before in (("_parameters", params), ("_buffers", buffers)):
                now = getattr(m, kind)
                for k, v in list(now.items()):
                    if k in before and v is not before[k]:
                        replaced.append(f"{mname}.{k}")
                        now[k] = before[k]
            self._scrub(m.__dict__, mname, skip=_BASE_MODULE_KEYS)
        for name, obj in self.objects.values():
            self._scrub(vars(obj), name)
        if replaced:
            raise CapturedStateError(
                f"{self.api}: the function assigns new tensors to {', '.join(replaced)}, "
                f"which it does not take as arguments; the assignment happened while "
                f"tracing, never on a call (it was undone). pjit functions must be pure: "
                f"pass the state in as an argument and return its new value (for module "
                f"buffers, torch.func.functional_call with the buffers as an argument; "
                f"docs/concepts.md, 'Module state')."
            )

    def _scrub(self, attrs: dict, owner: str, skip=frozenset()) -> None:
        for k, v in list(attrs.items()):
            if k in skip:
                continue
            if _holds_tracing_tensor(v):
                attrs[k] = LeakedTracer(
                    f"{owner}.{k} was set by the function while {self.api} traced it, so it "
                    f"holds a tracing value, not a tensor. Return the value from the "
                    f"function instead (e.g. `return loss, ...`) and read it from the "
                    f"call's outputs."
                )


def _holds_tracing_tensor(v) -> bool:
    if isinstance(v, torch.Tensor):
        return _torch.is_tracing_tensor(v)
    if isinstance(v, (list, tuple)) and len(v) <= 64:
        return any(isinstance(x, torch.Tensor) and _torch.is_tracing_tensor(x) for x in v)
    if isinstance(v, dict) and len(v) <= 64:
        return any(isinstance(x, torch.Tensor) and _torch.is_tracing_tensor(x) for x in v.values())
    return False


def _names(code: types.CodeType) -> set[str]:
    """Global names a code object (and the functions nested in it) may read."""
    out = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out |= _names(c)
    return out
