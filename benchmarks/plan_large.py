"""Plan training steps for meshes far larger than this machine, in one process:
``Mesh.abstract`` + meta-tensor inputs + ``pjit(...).lower()``. Prints, for one rank,
the memory it needs and the bytes it sends per step over each mesh axis.

    python benchmarks/plan_large.py                 # GPT-2-small on 128x4, a 7B shape on 64x8
    python benchmarks/plan_large.py --models gpt2 --layers 2

Nothing is allocated for parameters, optimizer state or batch (meta tensors), and
nothing communicates (torch's fake process group stands in for every axis). The same
lowering on an abstract 2x2 mesh gives the programs of 4 real ranks exactly
(tests/test_abstract.py). Writes ``benchmarks/results/plan_large.json``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks._models import git_rev, write_result  # noqa: E402
from examples import gpt  # noqa: E402

GiB = 2 ** 30


def models(layers: int | None) -> dict:
    def cfg(**kw):
        if layers is not None:
            kw["n_layers"] = layers
        return gpt.GPTConfig(**kw)

    return {
        # 12 heads do not split 8 ways: GPT-2-small's 512 ranks are 128 x 4
        "gpt2": dict(cfg=cfg(vocab=50304, d_model=768, n_heads=12, n_layers=12, seq=1024),
                     mesh=(128, 4), batch=512),
        "7b": dict(cfg=cfg(vocab=32000, d_model=4096, n_heads=32, n_layers=32, seq=2048),
                   mesh=(64, 8), batch=256),
    }


def plan(name: str, spec: dict, layouts: list[str], rank: int) -> list[dict]:
    from sharded import Mesh, P, optim
    from sharded.modes import DataParallelMode
    from sharded import pjit

    cfg = spec["cfg"]
    mesh = Mesh.abstract(spec["mesh"], ("dp", "tp"), rank=rank)
    with torch.device("meta"):
        params = gpt.init_params(cfg)
        opt = optim.adamw_init(params)
    ids = torch.empty(spec["batch"], cfg.seq, dtype=torch.long, device="meta")
    n_params = sum(t.numel() for t in torch.utils._pytree.tree_leaves(params))
    ps = gpt.tp_specs(params)
    rows = []
    for layout in layouts:
        mode = None if layout == "tp" else DataParallelMode("shard", bucket_bytes=25 << 20)
        f = pjit(gpt.train_step, in_specs=(ps, gpt.opt_specs(ps), P("dp"), P("dp")),
                 mesh=mesh, static_argnums=(4,), mode=mode)
        t0 = time.perf_counter()
        lowered = f.lower(params, opt, ids, ids, cfg)
        seconds = time.perf_counter() - t0
        mem = lowered.memory()
        by_axis = lowered.cost(by="axis")
        rows.append({
            "model": name, "params": n_params, "layers": cfg.n_layers, "mesh": spec["mesh"],
            "global_batch": spec["batch"], "seq": cfg.seq, "rank": rank,
            "layout": ("Megatron over tp, batch over dp (params replicated over dp)" if layout == "tp"
                       else "Megatron over tp + DataParallelMode('shard') over dp"),
            "input_GiB": mem["input_bytes"] / GiB, "peak_GiB": mem["peak_bytes"] / GiB,
            "peak_node": mem["peak_node"],
            "per_axis": {a: {"count": v["count"], "wire_MiB": v["wire_bytes"] / 2 ** 20}
                         for a, v in by_axis.items() if a != "total"},
            "lower_s": seconds,
        })
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt2,7b")
    ap.add_argument("--layers", type=int, default=None, help="override the layer count (quicker)")
    ap.add_argument("--layouts", default="tp,fsdp+tp")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "plan_large.json"))
    args = ap.parse_args(argv)
    specs = models(args.layers)
    rows = []
    for name in args.models.split(","):
        rows += plan(name, specs[name], args.layouts.split(","), args.rank)
    print(f"{'model':<6}{'params':>8}{'mesh':>9}  {'layout':<54}{'state GiB':>10}{'peak GiB':>9}"
          f"  per step and rank: collectives, MiB sent per axis")
    for r in rows:
        axes = ", ".join(f"{a}: {v['count']} / {v['wire_MiB']:.0f} MiB" for a, v in r["per_axis"].items())
        print(f"{r['model']:<6}{r['params'] / 1e9:>7.2f}B{'x'.join(map(str, r['mesh'])):>9}  "
              f"{r['layout']:<54}{r['input_GiB']:>10.3f}{r['peak_GiB']:>9.2f}  {axes}"
              f"  (lowered in {r['lower_s']:.0f} s)")
    result = {"benchmark": "plan_large", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "torch": torch.__version__, "git": git_rev(), "rows": rows}
    write_result(args.out, result)


if __name__ == "__main__":
    main()
