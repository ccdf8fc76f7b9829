"""Lowered: a traced and partitioned program, for inspection (no run, no communication)."""

from __future__ import annotations

from sharded.auto._explain import explain as explain_report
from sharded.passes import collectives, cost, memory


class Lowered:
    """What ``pjit(f).lower(*args)`` returns.

    - ``global_graph``: the single-device program (aten ops, global shapes).
    - ``local_graph``: what this rank runs (local shapes, functional collectives).
    - ``as_text()``: the local program as Python code, collectives annotated.
    - ``cost(by="kind" | "axis")``: collectives by kind (or mesh axis), with bytes
      moved per call on this rank.
    - ``collectives()``: each collective in program order.
    - ``memory()``: this rank's memory while it runs the program (a static estimate).
    - ``compile_times()``: seconds spent tracing, partitioning, in the passes and (once
      it has compiled) in inductor; ``runner()``: what runs the program now.
    - ``backward``: for a call whose inputs require grad (or under torch.func.grad,
      vjp, jacrev), the backward program's ``Lowered`` (NOTE [pjit under autograd] in
      sharded/_autograd.py); None otherwise.
    - ``donated``: ``{donated input path: output path that shares its storage, or
      None}`` (NOTE [Donation] in sharded/_program.py); empty without donation.
    - AUTO specs (docs/auto.md): ``layouts`` is ``{"inputs": {path: P}, "outputs":
      {path: P}}``, the specs the solver chose; ``in_specs`` and ``out_specs`` are the
      pjit's in_specs and out_specs with every AUTO decided (a spec per tensor, in
      the arguments' structure: reusable as hand-written specs, which give this same
      program where ``auto["chosen"] == "propagation"``); ``auto`` is the solver's
      report (the terms of its objective, the memory, the times, the candidates) and
      ``explain()`` says it in words, block by block.
    - ``pipeline``: for a step that calls ``sharded.pipeline(...)``, its schedule:
      stages, per-stage and per-rank memory, the bubble fraction and each rank's
      sends, receives and compute slots (docs/pipeline.md); None otherwise.
      ``as_text()`` starts with it and shows this rank's pieces.
    """

    backward: "Lowered | None"
    donated: dict[str, str | None]

    def __init__(self, compiled, name: str):
        self._c = compiled
        self.name = name
        backward = getattr(compiled, "backward", None)
        self.backward = Lowered(backward, f"{name} backward") if backward is not None else None
        self.donated = dict(getattr(compiled, "reused", {}))
        self.global_graph = compiled.global_graph
        self.local_graph = compiled.local_graph
        self.mesh = compiled.mesh
        self.in_specs = list(compiled.in_specs)
        self.out_placements = list(compiled.out_placements)
        # The layout a mode chose for each input and output, where it chooses them
        # (DataParallelMode: {"inputs": {path: (kind, P)}, "outputs": {...}}).
        self.layouts = compiled.layouts
        self.auto = getattr(compiled, "auto", None)
        self.out_specs = None
        if self.auto is not None:
            self.in_specs, self.out_specs = compiled.auto_specs
        self.pipeline = compiled.pipeline_report() if hasattr(compiled, "pipeline_report") else None

    def explain(self) -> str:
        """Why the AUTO solver chose these layouts: the chosen spec per block of
        inputs, the predicted compute, communication and memory, and the moves it pays
        for, most expensive first (a call with AUTO specs only)."""
        if self.auto is None:
            raise ValueError(f"{self.name}: explain() describes AUTO specs; this pjit has none "
                             f"(every spec was given by hand).")
        return explain_report(self.auto, self.cost()["total"])

    def collectives(self):
        """Each collective of this rank's program, in program order (a pipelined
        step: of its pieces, in the order a step meets them; a micro-batch's piece
        runs once per micro-batch)."""
        if self.pipeline is not None:
            return [c for _, gm in self._c.pieces() for c in collectives(gm, self.mesh)]
        return collectives(self.local_graph, self.mesh)

    def cost(self, by: str = "kind") -> dict:
        """Collectives per call on this rank, by kind (``by="axis"``: by mesh axis),
        each ``{"count", "bytes", "wire_bytes"}``, and their ``"total"`` (a pipelined
        step: its pieces', a micro-batch's counted once per micro-batch)."""
        if self.pipeline is None:
            return cost(self.local_graph, self.mesh, by)
        out: dict = {"total": {"count": 0, "bytes": 0, "wire_bytes": 0}}
        m = self.pipeline["microbatches"]
        for name, gm in self._c.pieces():
            times = m if name[0] in "FBIW" else 1
            for key, c in cost(gm, self.mesh, by).items():
                acc = out.setdefault(key, dict.fromkeys(c, 0))
                for k, v in c.items():
                    acc[k] += v * times
        return out

    def memory(self) -> dict:
        """This rank's memory while it runs the program, estimated from the local
        graph: ``input_bytes`` (its blocks of the inputs: parameters, optimizer state,
        batch), ``output_bytes`` (new outputs), ``peak_bytes`` (the most alive at once:
        inputs plus every intermediate from its allocation to its last use, as the
        generated code frees it) and ``peak_node``. Lowering runs nothing, so this
        works on ``Mesh.abstract`` meshes of any size and with meta-tensor inputs.
        A pipelined step: this rank's estimate from ``pipeline`` (its stages' state
        plus the activations of the micro-batches it holds at once)."""
        if self.pipeline is not None:
            r = self.pipeline["ranks"][self._c.pp_rank]
            return {"input_bytes": r["state_bytes"], "output_bytes": r["state_bytes"],
                    "peak_bytes": r["bytes_estimate"], "peak_node": None}
        return memory(self.local_graph)

    def compile_times(self) -> dict:
        """Seconds this program took to build: ``trace`` (make_fx of the function),
        ``partition`` (the mode's expansion into this rank's program), ``passes``
        (bucketing, overlap, reinplacing), and ``inductor``: the compile of the
        program into inductor's code (with its first run) once the runner has compiled
        it (NOTE [Runners]), else None."""
        times = dict(self._c.times)     # (a backward's trace is its forward's: 0)
        times["inductor"] = getattr(self._c.runner, "compile_seconds", None)
        return times

    def runner(self) -> str:
        """What runs this program now: ``"graph"``, ``"inductor"``, or ``"graph
        (compile failed)"`` (NOTE [Runners]); with ``compile="auto"`` the graph
        until the program has run often enough."""
        return getattr(self._c.runner, "kind", "graph")

    def as_text(self, which: str = "local") -> str:
        """The ``"local"`` (this rank's) or ``"global"`` program as Python code,
        each collective annotated with its kind, shape and mesh axis."""
        if self.pipeline is not None and which == "local":
            lines = [f"# {self.name} on {self.mesh!r}, rank {self.mesh.rank}, pipelined"]
            lines += ["# " + line for line in self._c.pipeline_text().splitlines()]
            for name, gm in self._c.pieces():
                lines.append(f"# piece {name}")
                lines += self._annotated(gm)
            return "\n".join(lines)
        gm = self.local_graph if which == "local" else self.global_graph
        lines = [f"# {self.name} on {self.mesh!r}, rank {self.mesh.rank}, {which} program"]
        return "\n".join(lines + self._annotated(gm))

    def _annotated(self, gm) -> list[str]:
        calls = {c.node: c for c in collectives(gm, self.mesh)}
        lines = []
        for line in gm.code.strip("\n").splitlines():
            name = line.strip().split(" = ", 1)[0]
            if name in calls:
                line += f"  # {calls[name]}"
            lines.append(line)
        return lines

    def __repr__(self):
        c = self.cost()["total"]
        return f"<Lowered {self.name}: {c['count']} collectives, {c['bytes']} bytes/call>"
