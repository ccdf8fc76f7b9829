"""The program's fingerprint: text that is equal on every rank of a correct SPMD
program, hashed into the token the ranks compare on every call (sharded/sync.py), and
read back in full when they differ. Also the ambient process state that changes what
tracing records (part of the cache key)."""

from __future__ import annotations

import dataclasses
import enum
import re
import types

import torch
import torch.fx as fx

from sharded import _torch
from sharded.data import value_digests
from sharded.spec import P


def fmt_meta(m) -> str:
    """``float32[4, 8]``: a tensor's dtype and shape, as messages and the fingerprint
    write them."""
    return f"{str(m.dtype).replace('torch.', '')}{list(m.shape)}"


_AUTOCAST_DEVICES = ("cpu", "cuda")


def ambient() -> tuple:
    """Process state that changes what tracing records: the default dtype (factory
    ops) and autocast (casts inserted before dispatch)."""
    autocast = tuple((d, torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES
                     if torch.is_autocast_enabled(d))
    return (torch.get_default_dtype(), autocast)


def ambient_text(amb: tuple) -> str:
    dtype, autocast = amb
    text = f"default dtype {dtype}"
    if autocast:
        text += ", autocast " + ", ".join(f"{d} {t}" for d, t in autocast)
    return text


_ADDRESS = re.compile(r" (object )?at 0x[0-9a-fA-F]+")


def stable_repr(v, depth: int = 0) -> str:
    """``v`` as text that is equal on every rank for equal values: no memory
    addresses (an object's default repr has one), full length (hashed, not cut)."""
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
        return repr(v)
    if isinstance(v, torch.device):
        return f"device({v.type!r})"      # cuda:0 on rank 0 is cuda:1 on rank 1
    if isinstance(v, (torch.dtype, P)):
        return repr(v)
    if isinstance(v, enum.Enum):
        return f"{type(v).__qualname__}.{v.name}"
    if isinstance(v, type):
        return f"{v.__module__}.{v.__qualname__}"
    if isinstance(v, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        return f"{getattr(v, '__module__', '')}.{getattr(v, '__qualname__', repr(v))}"
    if depth > 6:
        return f"<{type(v).__qualname__}>"
    if isinstance(v, (list, tuple)):
        inner = ", ".join(stable_repr(x, depth + 1) for x in v)
        return f"{type(v).__qualname__}({inner})"
    if isinstance(v, (set, frozenset)):
        return f"{type(v).__qualname__}({sorted(stable_repr(x, depth + 1) for x in v)})"
    if isinstance(v, dict):
        items = ", ".join(f"{stable_repr(k, depth + 1)}: {stable_repr(x, depth + 1)}"
                          for k, x in v.items())
        return f"{type(v).__qualname__}({{{items}}})"
    if dataclasses.is_dataclass(v):
        fields = ", ".join(f"{f.name}={stable_repr(getattr(v, f.name, None), depth + 1)}"
                           for f in dataclasses.fields(v))
        return f"{type(v).__qualname__}({fields})"
    if type(v).__repr__ is object.__repr__:
        attrs = getattr(v, "__dict__", None)
        inner = stable_repr(attrs, depth + 1) if isinstance(attrs, dict) else ""
        return f"<{type(v).__module__}.{type(v).__qualname__} {inner}>"
    return _ADDRESS.sub("", repr(v))


def program_lines(gm: fx.GraphModule) -> list[str]:
    """The global program as text that is equal on every rank of a correct SPMD
    program: each node's op, literal arguments (aten ops; other ops' integers can be
    ids local to a process) and output shape. A rank-dependent branch, constant or
    shape shows here."""
    out = []
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        shape = _fmt_val(val)
        if n.op == "placeholder":
            out.append(f"{n.name}: input {shape}")
        elif n.op == "get_attr":
            t = getattr(gm, n.target, None)
            text = f"{n.name}: constant {shape or _fmt_val(t)}"
            if isinstance(t, torch.Tensor) and not _torch.is_tracing_tensor(t):
                # a captured tensor is one global value too (NOTE [Per-rank data]): its
                # values, or their digest, are part of the program the ranks compare
                if t.numel() <= 16:
                    text += f" = {t.detach().cpu().flatten().tolist()}"
                else:
                    text += f" with values {value_digests([t])[0]:016x}"
            out.append(text)
        elif n.op == "output":
            out.append(f"output {[_fmt_val(a.meta.get('val')) if isinstance(a, fx.Node) else repr(a) for a in n.args[0]]}")
        else:
            aten = getattr(n.target, "namespace", None) in ("aten", "prims")
            args = ", ".join([_fmt_arg(a, aten) for a in n.args]
                             + [f"{k}={_fmt_arg(v, aten)}" for k, v in n.kwargs.items()])
            out.append(f"{n.name} = {n.target}({args}) -> {shape}")
    return out


def _fmt_val(v) -> str:
    if isinstance(v, torch.Tensor):
        return fmt_meta(v)
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(_fmt_val(x) for x in v) + ")"
    return "" if v is None else type(v).__name__


def _fmt_arg(a, literal: bool) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_fmt_arg(x, literal) for x in a) + "]"
    if isinstance(a, torch.device):
        return f"device({a.type!r})"
    if not literal and isinstance(a, int) and not isinstance(a, bool):
        return "#"
    return stable_repr(a)
