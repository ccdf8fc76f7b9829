"""The AUTO solver's program with every pair of layouts against the fewer pairs of NOTE
[Moves after a pointwise op] (sharded/auto/_solve.py), on a program past FOLLOW_ABOVE:
the 1-layer Hugging Face Llama SGD step of tests/test_auto.py on
``Mesh.abstract((2, 2), ("dp", "tp"))``, parameters AUTO, the ids ``P("dp")``.

    python benchmarks/bench_auto_solve.py                  # the stated H100 table
    python benchmarks/bench_auto_solve.py --model PATH     # a CostModel.to_dict() JSON
                                                           # (or a cost-model cache file)

One process, no ranks. Per variant: the program's columns and rows, the solve and
build seconds, the solver's objective; writes ``benchmarks/results/auto_solve.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks._models import git_rev, write_result  # noqa: E402
from sharded import AUTO, Mesh, P, pjit  # noqa: E402
from sharded.auto import _solve  # noqa: E402
from sharded.auto.cost import CostModel  # noqa: E402

VOCAB, SEQ = 64, 8


def _llama():
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=1, max_position_embeddings=2 * SEQ)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).train()


def _lower(model, cost_model):
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(1))

    def step(p, ids):
        def loss_of(p):
            return torch.func.functional_call(model, p, (ids,), {"labels": ids,
                                                                "use_cache": False}).loss

        grads, loss = torch.func.grad_and_value(loss_of)(p)
        return {k: v - 0.1 * grads[k] for k, v in p.items()}, loss

    f = pjit(step, in_specs=(AUTO, P("dp")), out_specs=(AUTO, P()),
             mesh=Mesh.abstract((2, 2), ("dp", "tp")), cost_model=cost_model)
    t0 = time.perf_counter()
    auto = f.lower(params, ids).auto
    return {"lower_s": time.perf_counter() - t0, "build_s": auto["build_s"],
            "solve_s": auto["solve_s"], "variables": auto["variables"],
            "constraints": auto["constraints"], "objective_ms": auto["objective_s"] * 1e3,
            "chosen": auto["chosen"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a CostModel.to_dict() JSON (default: CostModel.h100())")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "auto_solve.json"))
    a = ap.parse_args(argv)
    if a.model:
        with open(a.model) as fh:
            d = json.load(fh)
        cost_model = CostModel.from_dict(d.get("model", d))
    else:
        cost_model = CostModel.h100()
    model = _llama()
    threshold = _solve.FOLLOW_ABOVE
    runs = {}
    for name, above in (("every pair", math.inf), ("fewer pairs", threshold)):
        _solve.FOLLOW_ABOVE = above
        try:
            runs[name] = _lower(model, cost_model)
        finally:
            _solve.FOLLOW_ABOVE = threshold
        r = runs[name]
        print(f"{name:<12} {r['variables']:>8,} columns {r['constraints']:>7,} rows  solve "
              f"{r['solve_s']:7.1f} s  build {r['build_s']:5.1f} s  objective "
              f"{r['objective_ms']:.4f} ms  kept: {r['chosen']}", flush=True)
    write_result(a.out, {"benchmark": "auto_solve", "date": datetime.datetime.now().isoformat(
        timespec="seconds"), "git": git_rev(), "torch": torch.__version__,
        "cost_model": cost_model.name, "follow_above": threshold, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
