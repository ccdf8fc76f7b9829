"""Activation checkpointing: gpt-tiny train steps with and without block-wise remat,
pjit against FSDP2, step time and measured peak memory side by side in one run.

Rows (every one on ``--world`` gloo CPU ranks, the batch split over them, AdamW):

  pjit_fsdp         pjit, DataParallelMode("shard"), donated state, no remat
  pjit_fsdp_remat   the same with every block under ``sharded.remat`` (save nothing)
  fsdp2             fully_shard on every block and the root, no checkpointing
  fsdp2_ac          the same with every block under ``torch.utils.checkpoint``
                    (use_reentrant=False: save nothing, the same policy)

With ``--rows pjit_fsdp_inductor,pjit_fsdp_remat_inductor`` (not in the default run:
inductor's compile on CPU takes minutes), the two pjit rows run inductor's code
(``compile=True``): the measured drop is that of the compiled program.

Memory is measured in processes of their own (glibc set up so that resident memory
follows allocations: ``_models.peak_resident_bytes``), each row built before the
window, then one step inside it: the step's peak above the state it starts from (the
activations, the gradients, the temporaries), the least of two rounds. "activation
memory" is that peak less the row's gradient bytes (the full gradients of this rank's
parameters exist at once in every row). ``Lowered.memory()``'s static estimate of the
pjit rows is printed beside it. Times: the median of ``--iters`` interleaved rounds.
Every row's loss after its steps is checked against the single-device steps (the
remat rows compute the same values). Writes ``benchmarks/results/remat.json``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks import _models as M  # noqa: E402
from benchmarks._models import git_rev, write_result  # noqa: E402
from examples import gpt  # noqa: E402
from sharded import launch  # noqa: E402

ROWS = ("pjit_fsdp", "pjit_fsdp_remat", "fsdp2", "fsdp2_ac")


def _block(blk, x, cfg):
    """One block of ``gpt.forward`` (the same math)."""
    d = cfg.d_model
    x = x + gpt._attention(blk["attn"], F.layer_norm(x, (d,), blk["ln1_w"], blk["ln1_b"]), cfg)
    return x + gpt._mlp(blk["mlp"], F.layer_norm(x, (d,), blk["ln2_w"], blk["ln2_b"]))


def remat_loss(params, ids, targets, cfg):
    """``gpt.loss_fn`` with every block under ``sharded.remat``."""
    from sharded import remat

    d = cfg.d_model
    x = F.embedding(ids, params["wte"]) + params["wpe"][: ids.shape[1]]
    block = remat(functools.partial(_block, cfg=cfg))
    for blk in params["blocks"]:
        x = block(blk, x)
    logits = F.layer_norm(x, (d,), params["lnf_w"], params["lnf_b"]) @ params["wte"].T
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _step(loss_fn, cfg, params, opt_state, ids, targets):
    from sharded import optim

    grads, loss = torch.func.grad_and_value(loss_fn)(params, ids, targets, cfg)
    params, opt_state = optim.adamw(params, grads, opt_state, lr=1e-3)
    return params, opt_state, loss


class _CheckpointedBlocks(M.GPTBlocks):
    """``GPTBlocks`` with each block under torch.utils.checkpoint."""

    def forward(self, ids):
        x = F.embedding(ids, self.wte) + self.wpe[: ids.shape[1]]
        for blk in self.blocks:
            x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)
        x = F.layer_norm(x, (self.cfg.d_model,), self.lnf_w, self.lnf_b)
        return x @ self.wte.T


def _config(a):
    return gpt.GPTConfig(vocab=a["vocab"], d_model=a["d_model"], n_heads=a["heads"],
                         n_layers=a["layers"], seq=a["seq"])


def _build(row: str, a: dict, world: int, rank: int):
    """(step(), state) for a row, its first step run."""
    from torch.distributed.fsdp import fully_shard

    from sharded import Mesh, P, optim, pjit
    from sharded.modes import DataParallelMode

    cfg = _config(a)
    params = gpt.init_params(cfg)
    ids, targets = gpt.batch(cfg, a["batch"])
    st: dict = {}
    if row.startswith("pjit"):
        mesh = Mesh((world,), ("dp",))
        mode = DataParallelMode("shard", compile=row.endswith("_inductor"))
        loss_fn = remat_loss if "_remat" in row else gpt.loss_fn
        f = pjit(functools.partial(_step, loss_fn, cfg), in_specs=(P(), P(), P("dp"), P("dp")),
                 mesh=mesh, mode=mode, donate_argnums=(0, 1))
        st["p"] = pjit(lambda t: optree_clone(t), in_specs=P(), mesh=mesh, mode=mode)(params)
        st["o"] = pjit(optim.adamw_init, in_specs=P(), mesh=mesh, mode=mode)(params)

        def step():
            st["p"], st["o"], loss = f(st["p"], st["o"], ids, targets)
            st["loss"] = float(loss.full_tensor())
        st["lower"] = lambda: f.lower(st["p"], st["o"], ids, targets)
        st["grad_bytes"] = sum(t.numel() * 4 for t in optree_leaves(params)) // world
    else:
        cls = _CheckpointedBlocks if row.endswith("_ac") else M.GPTBlocks
        model = cls(params, cfg)
        mesh = Mesh((world,), ("dp",)).device_mesh
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = M.torch_adamw(model.parameters())
        local = tuple(t.chunk(world)[rank] for t in (ids, targets))

        def step():
            opt.zero_grad(set_to_none=True)
            loss = M.module_loss(model, *local)
            loss.backward()
            opt.step()
            loss = loss.detach().clone()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
            st["loss"] = float(loss)
        # FSDP2 reduce-scatters each gradient as it is made; the full gradients of a
        # block exist at once (as in the pjit rows, which hold every full gradient)
        st["grad_bytes"] = sum(t.numel() * 4 for t in optree_leaves(params)) // world
    step()
    return step, st


def optree_clone(tree):
    import optree

    return optree.tree_map(torch.clone, tree)


def optree_leaves(tree):
    import optree

    return optree.tree_leaves(tree)


def _rank_main(a: dict) -> dict:
    import sharded.rules  # noqa: F401  (SDPA sharding rules)

    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    if a["phase"] == "memory":
        out["method"], measure = M.peak_measure()
        out["peak"], out["grad_bytes"], out["estimate"] = {}, {}, {}
        for row in a["rows"]:
            step, st = _build(row, a, world, rank)      # state and one step: outside the window
            step()
            for _ in range(2):
                dist.barrier()
                peak = measure(step)
                out["peak"][row] = min(peak, out["peak"].get(row, peak))
            out["grad_bytes"][row] = st["grad_bytes"]
            if "lower" in st:
                out["estimate"][row] = st["lower"]().memory()["peak_bytes"]
            del step, st
        return out
    steps, states = {}, {}
    for row in a["rows"]:
        steps[row], states[row] = _build(row, a, world, rank)
    times = M.timed_interleaved(steps, a["warmup"], a["iters"])
    return {"times": times, "loss": {r: states[r]["loss"] for r in a["rows"]},
            "steps": 1 + a["warmup"] + a["iters"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    M.gpt_arguments(ap, layers=4, batch=16, seq=128, warmup=2, iters=6)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "remat.json"))
    args = ap.parse_args(argv)
    a = {k: getattr(args, k) for k in ("vocab", "d_model", "heads", "layers", "batch", "seq",
                                       "warmup", "iters")}
    a["rows"] = [r for r in args.rows.split(",") if r]

    t0 = time.perf_counter()
    timed = launch(_rank_main, args.world, {**a, "phase": "time"})
    memory = launch(_rank_main, args.world, {**a, "phase": "memory"})
    wall = time.perf_counter() - t0

    rows = a["rows"]
    ms = {r: max(statistics.median(t["times"][r]) for t in timed) * 1e3 for r in rows}
    peak = {r: max(m["peak"][r] for m in memory) for r in rows}
    act = {r: peak[r] - memory[0]["grad_bytes"][r] for r in rows}
    estimate = memory[0]["estimate"]
    # the reference: the single-device steps, as many as every row ran
    cfg = _config(a)
    from sharded import optim

    p = gpt.init_params(cfg)
    o = optim.adamw_init(p)
    ids, targets = gpt.batch(cfg, a["batch"])
    for _ in range(timed[0]["steps"]):
        p, o, loss = _step(gpt.loss_fn, cfg, p, o, ids, targets)
    ref = float(loss)
    losses = timed[0]["loss"]
    same = {r: abs(losses[r] - ref) <= 1e-3 * abs(ref) for r in rows}

    def ratio(n, d, table):
        return table[n] / table[d] if n in table and d in table and table[d] else None

    ratios = {
        "time pjit_fsdp_remat/pjit_fsdp": ratio("pjit_fsdp_remat", "pjit_fsdp", ms),
        "activation memory pjit_fsdp_remat/pjit_fsdp": ratio("pjit_fsdp_remat", "pjit_fsdp", act),
        "step peak pjit_fsdp_remat/pjit_fsdp": ratio("pjit_fsdp_remat", "pjit_fsdp", peak),
        "step peak pjit_fsdp_remat/fsdp2_ac": ratio("pjit_fsdp_remat", "fsdp2_ac", peak),
        "time pjit_fsdp_remat/fsdp2_ac": ratio("pjit_fsdp_remat", "fsdp2_ac", ms),
        "time fsdp2_ac/fsdp2": ratio("fsdp2_ac", "fsdp2", ms),
        "activation memory fsdp2_ac/fsdp2": ratio("fsdp2_ac", "fsdp2", act),
        "estimate pjit_fsdp_remat/pjit_fsdp": ratio("pjit_fsdp_remat", "pjit_fsdp", estimate),
        "time pjit_fsdp_remat_inductor/pjit_fsdp_inductor":
            ratio("pjit_fsdp_remat_inductor", "pjit_fsdp_inductor", ms),
        "activation memory pjit_fsdp_remat_inductor/pjit_fsdp_inductor":
            ratio("pjit_fsdp_remat_inductor", "pjit_fsdp_inductor", act),
    }
    ratios = {k: v for k, v in ratios.items() if v is not None}
    print(f"gpt-tiny {cfg}, batch {a['batch']}, world {args.world}; memory: "
          f"{memory[0]['method']} (peak of one step above its state, max over ranks)")
    print(f"{'row':<18}{'ms/step':>9}{'step peak MiB':>15}{'activations MiB':>17}"
          f"{'estimate MiB':>14}{'loss':>9}{'same':>6}")
    for r in rows:
        est = f"{estimate[r] / 2**20:.2f}" if r in estimate else "-"
        print(f"{r:<18}{ms[r]:>9.1f}{peak[r] / 2**20:>15.2f}{act[r] / 2**20:>17.2f}{est:>14}"
              f"{losses[r]:>9.4f}{'yes' if same[r] else 'NO':>6}")
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}" if v is not None else f"{k}: -")
    result = {"benchmark": "remat", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "torch": torch.__version__, "git": git_rev(), "world_size": args.world,
              "cpu_count": os.cpu_count(), "config": a, "median_ms": ms,
              "step_peak_bytes": peak, "activation_bytes": act, "lowered_peak_bytes": estimate,
              "memory_method": memory[0]["method"], "loss": losses, "reference_loss": ref,
              "same_loss": same, "ratios": ratios, "wall_s": wall,
              "times_ms_per_rank": {r: [[x * 1e3 for x in t["times"][r]] for t in timed]
                                    for r in rows}}
    write_result(args.out, result, f"{wall:.0f} s")
    if not all(same.values()):
        raise SystemExit(f"rows whose loss differs from one device: {[r for r in rows if not same[r]]}")


if __name__ == "__main__":
    main()
