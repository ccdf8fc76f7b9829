"""Train a small GPT on local CPU ranks: FSDP x tensor parallelism, checkpoints, resume.

    pip install -e '.[examples]'                            # tqdm and matplotlib
    python examples/gpt_train.py                            # 4 local ranks, mesh ("dp"=2, "tp"=2)
    python examples/gpt_train.py --resume --dp 4 --tp 1     # continue on a 1-D mesh of 4
    torchrun --nproc-per-node 4 examples/gpt_train.py       # the same under torchrun
    python examples/gpt_train.py --bf16 --remat block --schedule cosine --warmup 20 --clip 1.0
    python examples/gpt_train.py --pp 2 --dp 2 --tp 1       # 4 ranks, ("pp"=2, "dp"=2): pipelined

The model is the plain ``nn.Module`` GPT of ``examples/gpt_module.py`` with dropout on.
Its tensor-parallel plan (torchtitan's sequence-parallel Llama plan by default, or
Megatron) lays the parameters out over mesh axis "tp"; ``DataParallelMode("shard")``
over "dp" splits the batch and shards parameters, gradients and AdamW moments again
over "dp" (FSDP x TP). The whole step, forward, backward with dropout, and AdamW, is
one pjit program per rank.

The large-run essentials are flags: ``--bf16`` computes in bf16 with fp32 master
weights and fp32 gradient reductions (``DataParallelMode(param_dtype=, reduce_dtype=)``,
docs/precision.md), ``--remat block`` recomputes each block's activations in the
backward (``sharded.remat``, docs/remat.md), ``--schedule cosine --warmup N`` makes the
learning rate a traced function of the step (no retrace as it changes) and ``--clip``
clips the global gradient norm with one scalar all-reduce per step (docs/optim.md).

``--pp N`` puts a pipeline axis "pp" of size N in front of the mesh (world size
pp * dp * tp): the loss, the same forward with ``pipe_split(h, auto=True)`` before every
block but the first, runs as ``sharded.pipeline(loss_fn, microbatches=M, schedule=...,
virtual_stages=V)`` inside the step (docs/pipeline.md); the lowering picks the stage
boundaries that even out the parameters, so N * V must be at most ``--layers``. The LM
head is its own parameter (not tied to the token embedding), so it can sit on the last
stage while the embedding sits on the first. Each stage's parameters and moments live
on its "pp" coordinate's ranks; the loss is on every rank.

Every ``--ckpt-every`` steps the parameters, the optimizer state, the step and the
random-number state go to ``<run-dir>/checkpoint`` (``sharded.checkpoint``: each rank
writes its own shards; the previous checkpoint stays loadable until the new one is
complete). ``--resume`` continues from it on whatever mesh this run has: the
checkpoint is resharded on load, and dropout draws the same numbers on any mesh, so
the loss goes on as if the run had never stopped. Each rank loads only its own rows
(a DataLoader with a DistributedSampler over the "dp" groups, made the global batch by
``sharded.from_local_data``: docs/data.md); the data is a function of the step and the
row (a synthetic language from a fixed random Markov chain), so it needs no loader
state.

Rank 0 shows a progress bar (loss, tokens/s), keeps ``<run-dir>/metrics.csv``, and at
the end draws ``<run-dir>/loss.png``: the run's loss next to the single-device loss
(the same program, pjit on one process, computed once and cached) and the entropy
of the data, the lowest loss any model can reach.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples import gpt_module as gm  # noqa: E402
import sharded  # noqa: E402
from sharded import Mesh, P, checkpoint, from_local_data, gather, optim, precision  # noqa: E402
from sharded import random as srandom  # noqa: E402
from sharded.modes import DataParallelMode  # noqa: E402
from sharded.plans import parallelize  # noqa: E402
from sharded import pjit  # noqa: E402


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides the numbers of a run (a resumed run must match it)."""

    model: gm.Config = field(default_factory=lambda: gm.Config(
        vocab=64, d_model=64, n_heads=4, n_layers=2, seq=32, dropout=0.1))
    batch_size: int = 16
    lr: float = 3e-3
    schedule: str = "constant"   # "cosine": linear warmup, then cosine decay to lr / 10
    warmup: int = 0              # warmup steps of the cosine schedule
    decay_steps: int = 200       # where the cosine schedule reaches lr / 10
    clip: float = 0.0            # max global gradient norm (0: no clipping)
    bf16: bool = False           # compute in bf16, fp32 masters, fp32 gradient reductions
    seed: int = 0
    branching: int = 4       # next-token choices per token in the synthetic language

    def as_dict(self) -> dict:
        d = asdict(self)
        return {**{f"model.{k}": v for k, v in d.pop("model").items()}, **d}


# -- data: a synthetic language ------------------------------------------------------

def markov_chain(tc: TrainConfig):
    """A fixed random Markov chain over the vocabulary: each token has ``branching``
    possible successors with fixed probabilities. Returns (successors [V, k],
    probabilities [V, k], the chain's entropy rate in nats)."""
    g = torch.Generator().manual_seed(1000 + tc.seed)
    v, k = tc.model.vocab, tc.branching
    succ = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(v)])
    probs = torch.softmax(1.5 * torch.randn(v, k, generator=g), dim=-1)
    # Entropy rate: per-token entropy weighted by the stationary distribution.
    trans = torch.zeros(v, v, dtype=torch.float64)
    trans.scatter_(1, succ, probs.double())
    pi = torch.full((v,), 1.0 / v, dtype=torch.float64)
    for _ in range(500):
        pi = pi @ trans
    h = -(probs.double() * probs.double().log()).sum(-1)
    return succ, probs, float((pi * h).sum())


class MarkovText(torch.utils.data.Dataset):
    """Sequences of the synthetic language for steps ``start`` .. ``end - 1``, numbered
    for a ``DistributedSampler`` over ``dp`` data-parallel groups.

    Each sequence is a function of (seed, step, row): row ``row`` of the global batch
    of step ``step``, the same in every run and on every mesh. A DistributedSampler
    without shuffling deals index ``i`` to group ``i % dp``; the numbering below makes
    group ``r``'s ``batch_size // dp`` sequences of a step rows ``r * b .. (r + 1) * b
    - 1`` of that step's global batch, so the batch that ``from_local_data`` makes of
    the groups' pieces is that step's global batch whatever ``dp`` is (and dropout,
    whose numbers follow the global element index, draws the same numbers for each
    row on every mesh).
    """

    def __init__(self, tc: TrainConfig, dp: int, start: int, end: int, chain=None):
        self.tc, self.dp, self.start, self.end = tc, dp, start, end
        self.succ, self.probs, _ = chain or markov_chain(tc)

    def __len__(self) -> int:
        return (self.end - self.start) * self.tc.batch_size

    def __getitem__(self, i: int):
        big = self.tc.batch_size
        step, pos = self.start + i // big, i % big
        row = (pos % self.dp) * (big // self.dp) + pos // self.dp
        g = torch.Generator().manual_seed((self.tc.seed * 1_000_003 + step) * 65_537 + row)
        toks = torch.empty(self.tc.model.seq + 1, dtype=torch.long)
        toks[0] = torch.randint(0, self.tc.model.vocab, (1,), generator=g)
        for k in range(self.tc.model.seq):
            pick = torch.multinomial(self.probs[toks[k]], 1, generator=g)[0]
            toks[k + 1] = self.succ[toks[k], pick]
        return toks[:-1], toks[1:]


def loader(tc: TrainConfig, mesh: Mesh, start: int, end: int, chain=None):
    """This rank's batches of steps ``start`` .. ``end - 1``, each made the global batch
    (docs/data.md): a DistributedSampler over the "dp" groups (the "tp" ranks of a
    group load the same rows), then ``from_local_data(local, P("dp"))``."""
    dp = mesh.size("dp") if "dp" in mesh.axis_names else 1
    rank = mesh.coordinate()[mesh.axis_names.index("dp")] if "dp" in mesh.axis_names else 0
    if tc.batch_size % dp:
        raise SystemExit(f"--batch-size {tc.batch_size} does not split over {dp} 'dp' groups.")
    data = MarkovText(tc, dp, start, end, chain)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=dp, rank=rank,
                                                  shuffle=False, drop_last=True)
    batches = torch.utils.data.DataLoader(data, batch_size=tc.batch_size // dp,
                                          sampler=sampler, drop_last=True)
    spec = P("dp") if "dp" in mesh.axis_names else P()
    for ids, targets in batches:
        yield from_local_data((ids, targets), spec, mesh)


# -- the program -----------------------------------------------------------------------

def make_mesh(dp: int, tp: int, pp: int = 1) -> Mesh:
    """A mesh with the axes of size > 1: ("dp", "tp"), ("dp",) or ("tp",); one process
    gets ("dp",) of size 1. With ``pp`` > 1 the pipeline axis comes first: ("pp", "dp",
    "tp"), ("pp", "dp"), ("pp", "tp") or ("pp",)."""
    axes = [(n, s) for n, s in (("pp", pp), ("dp", dp), ("tp", tp)) if s > 1] or [("dp", 1)]
    return Mesh(tuple(s for _, s in axes), tuple(n for n, _ in axes))


@dataclass(frozen=True)
class PipelineConfig:
    """How ``--pp`` > 1 runs the loss (docs/pipeline.md): ``microbatches`` micro-batches
    (on each "dp" rank, of its own rows) in ``schedule``'s order over the mesh's "pp"
    axis, ``virtual`` stages per pp rank. Not part of TrainConfig: like the mesh, it may
    change on --resume."""

    pp: int = 1
    microbatches: int = 4
    schedule: str = "1F1B"
    virtual: int = 1


def make_pipelined_train_step(model: gm.GPT, update, pc: PipelineConfig, policy=None):
    """The train step of ``gm.make_train_step`` with its loss pipelined: the same
    forward (``torch.func.functional_call`` of the module), with a candidate stage
    boundary, ``pipe_split(h, auto=True)``, before every block but the first, run as
    ``pipeline(loss_fn, microbatches=, schedule=, virtual_stages=)`` and differentiated
    with ``torch.func.grad_and_value`` inside the step. The lowering picks
    ``pp * virtual - 1`` of the ``n_layers - 1`` candidates to even out the stages'
    parameter counts (the embeddings go with the first stage, ln_f and the head with
    the last), so ``pp * virtual`` must be at most ``n_layers`` (else pipeline's own
    error). The LM head is not tied to the token embedding (gm.GPT has its own
    ``head``), so the two may sit on different stages. Its value is the mean of the
    loss over the micro-batches: for the mean cross-entropy over equal-sized
    micro-batches, the whole batch's loss and gradient."""
    first = model.blocks[0]

    def call_block(blk, wrap=model.remat):
        # GPT.forward calls ``model.remat(blk)(x)`` for each block when model.remat is
        # set: the split goes in front of the (rematerialized) block, outside its region.
        f = wrap(blk) if wrap is not None else blk
        return f if blk is first else (lambda x: f(sharded.pipe_split(x, auto=True)))

    def loss_fn(params, ids, targets):
        return torch.func.functional_call(model, params, (ids, targets))

    if policy is not None:
        loss_fn = policy.wrap(loss_fn)
    loss = sharded.pipeline(loss_fn, microbatches=pc.microbatches, schedule=pc.schedule,
                            virtual_stages=pc.virtual)

    model.remat = call_block      # outside a traced pipeline, pipe_split returns h as is

    def train_step(params, opt_state, ids, targets):
        grads, value = torch.func.grad_and_value(loss)(params, ids, targets)
        params, opt_state = update(params, grads, opt_state)
        return params, opt_state, value

    return train_step


class Trainer:
    """The training state of one rank and the pjit programs that advance it.

    The parameter layout comes from the mesh: the plan's specs over "tp" (if the mesh
    has it) and ``DataParallelMode(dp_sharding)`` over "dp" (if it has it). Parameters
    and optimizer state are created by a pjit program under the same mode, so they
    are born in the layout the train step keeps them in.
    """

    def __init__(self, mesh: Mesh, tc: TrainConfig, *, plan: str = "sp",
                 dp_sharding: str = "shard", remat: str = "none",
                 pipe: PipelineConfig | None = None):
        self.mesh, self.tc = mesh, tc
        self.chain = markov_chain(tc)
        model = gm.GPT(tc.model, seed=tc.seed)
        params = {k: v.detach() for k, v in model.named_parameters()}
        if "tp" in mesh.axis_names:
            specs = parallelize(model, gm.PLANS[plan](), mesh, axis="tp")
        else:
            specs = {k: P() for k in params}
        opt_specs = {"step": P(), "m": specs, "v": specs}
        has_dp = "dp" in mesh.axis_names
        # bf16 (docs/precision.md): on the mode as FSDP2's MixedPrecisionPolicy where the
        # mesh has "dp"; in the function (the same casts) where it has only "tp"
        mp = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if tc.bf16 else {}
        mode = DataParallelMode(dp_sharding, **mp) if has_dp else None
        policy = precision.Policy(param_dtype=torch.bfloat16) if tc.bf16 and not has_dp else None
        data = P("dp") if has_dp else P()
        # Without the data-parallel mode, out_specs keep the layout; with it, the mode
        # gives the state its layout over "dp" (out_specs would override that).
        out = {} if has_dp else {"out_specs": (specs, opt_specs, P())}
        init_out = {} if has_dp else {"out_specs": (specs, opt_specs)}
        self._init = pjit(_init_state, in_specs=(specs,), mesh=mesh, mode=mode, **init_out)
        if remat != "none":    # docs/remat.md: each block's activations recomputed in the backward
            model.remat = functools.partial(sharded.remat, policy=_REMAT[remat])
        if pipe is not None:  # --pp > 1: stage state on its "pp" coordinate's slice of the mesh
            train_step = make_pipelined_train_step(model, functools.partial(_update, tc), pipe,
                                                   policy=policy)
        else:
            train_step = gm.make_train_step(model, functools.partial(_update, tc), policy=policy)
        self._step = pjit(train_step, in_specs=(specs, opt_specs, data, data), mesh=mesh,
                          mode=mode, **out)
        self.params, self.opt = self._init(params)
        self.step = 0
        srandom.manual_seed(tc.seed)

    def train_step(self, ids=None, targets=None) -> float:
        """One step on the global batch ``ids``, ``targets`` (DTensors made by
        ``loader``; by default, loaded here: the batch of ``self.step``); returns the
        loss."""
        if ids is None:
            ids, targets = next(loader(self.tc, self.mesh, self.step, self.step + 1, self.chain))
        self.params, self.opt, loss = self._step(self.params, self.opt, ids, targets)
        self.step += 1
        return float(gather(loss))

    def state(self) -> dict:
        return {"params": self.params, "opt": self.opt, "step": self.step,
                "rng": srandom.get_rng_state(), "config": self.tc.as_dict()}

    def save(self, path: str, *, async_save: bool = False):
        return checkpoint.save(path, self.state(), async_save=async_save)

    def restore(self, path: str) -> None:
        """Continue from the checkpoint at ``path``, resharded onto this mesh."""
        mine = self.tc.as_dict()
        saved = checkpoint.load(path, {"config": mine}, strict=False)["config"]
        diff = {k: (v, mine[k]) for k, v in saved.items() if mine[k] != v}
        if diff:
            raise SystemExit(
                f"the checkpoint at {path} was trained with another configuration "
                f"(saved, this run): {diff}; resume with the same model and data flags.")
        state = checkpoint.load(path, self.state())
        self.params, self.opt, self.step = state["params"], state["opt"], state["step"]
        srandom.set_rng_state(state["rng"])


def _init_state(params):
    return params, optim.adamw_init(params)


_REMAT = {"block": sharded.remat_policies.nothing_saveable,
          "dots": sharded.remat_policies.dots_saveable}


def _update(tc: TrainConfig, params, grads, opt_state):
    """Clip (one scalar all-reduce per step: docs/optim.md), then AdamW at the
    schedule's lr for this step, a traced value (no retrace as it changes)."""
    if tc.clip > 0:
        grads, _ = optim.clip_by_global_norm(grads, tc.clip)
    lr = tc.lr
    if tc.schedule == "cosine":
        lr = optim.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup, tc.decay_steps,
                                                end_value=tc.lr / 10)
    return optim.adamw(params, grads, opt_state, lr=lr)


# -- the run ---------------------------------------------------------------------------

def train(args, tc: TrainConfig) -> tuple[int, list]:
    """Train on this rank to ``args.steps``; returns the first step and, on rank 0,
    [(step, loss, tokens/s, mesh)] for each step run."""
    mesh = make_mesh(args.dp, args.tp, args.pp)
    rank0 = mesh.rank == 0
    t0 = time.perf_counter()
    pipe = pipe_config(args)
    trainer = Trainer(mesh, tc, plan=args.plan, dp_sharding=args.dp_sharding, remat=args.remat,
                      pipe=pipe)
    ckpt = os.path.join(args.run_dir, "checkpoint")
    if args.resume:
        if not checkpoint.exists(ckpt):
            raise SystemExit(f"--resume: no checkpoint at {ckpt}; run without --resume first.")
        trainer.restore(ckpt)
    mesh_text = ",".join(f"{n}={s}" for n, s in zip(mesh.axis_names, mesh.shape))
    if rank0:
        what = f"resumed at step {trainer.step}" if args.resume else "started"
        how = []
        if pipe is not None:
            how.append(f"{pipe.schedule} over 'pp', {pipe.microbatches} micro-batches"
                       + (f", {pipe.virtual} stages per rank" if pipe.virtual > 1 else ""))
        if "tp" in mesh.axis_names:
            how.append(f"{args.plan} plan over 'tp'")
        if "dp" in mesh.axis_names and mesh.size("dp") > 1:
            how.append(f"DataParallelMode({args.dp_sharding!r}) over 'dp'")
        how += ["bf16"] * tc.bf16 + [f"remat {args.remat}"] * (args.remat != "none")
        if tc.schedule == "cosine":
            how.append(f"warmup {tc.warmup} + cosine")
        if tc.clip > 0:
            how.append(f"clip {tc.clip:g}")
        print(f"mesh {mesh_text} ({', '.join(how) or 'one process'}): {what}", flush=True)
    start = trainer.step
    bar = _progress(rank0, trainer.step, args.steps)
    rows, tokens = [], tc.batch_size * tc.model.seq
    last = time.perf_counter()
    for ids, targets in loader(tc, mesh, trainer.step, args.steps, trainer.chain):
        loss = trainer.train_step(ids, targets)
        now = time.perf_counter()
        step_s, last = now - last, now
        rows.append((trainer.step - 1, loss, tokens / step_s, mesh_text))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens / step_s:,.0f}")
        if trainer.step % args.ckpt_every == 0 or trainer.step == args.steps:
            trainer.save(ckpt, async_save=args.async_ckpt)
    checkpoint.wait()
    if bar is not None:
        bar.close()
    if rank0:
        print(f"{len(rows)} steps in {time.perf_counter() - t0:.1f} s (compile included); "
              f"checkpoint at step {trainer.step}: {ckpt}", flush=True)
    return start, (rows if rank0 else [])


def _progress(show: bool, start: int, total: int):
    if not show:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        print("(pip install -e '.[examples]' for a progress bar)")
        return None
    return tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True)


def reference(args, tc: TrainConfig) -> list:
    """Single-device losses for steps 0 .. args.steps - 1: the same program, pjit on
    one process (the same dropout numbers), run in a process of its own.

    With --pp > 1 and dropout, the same pipelined loss on a one-rank "pp" mesh: dropout
    draws micro-batch j's numbers at its own place in the stream (docs/pipeline.md,
    random numbers), which is not where the whole-batch step draws them, so the
    reference runs the same micro-batches. Under "dp" each rank splits its own rows
    into the micro-batches; the rows are put in that order here (micro-batch j: rows j
    of each "dp" rank's blocks), which changes neither the mean loss nor its gradient.
    Without dropout the pipelined loss (the mean over equal micro-batches of a mean
    cross-entropy) is the whole batch's, and the reference is the whole-batch step."""
    pipe = _reference_pipe(args, tc)
    if pipe is None:
        trainer = Trainer(make_mesh(1, 1), tc)
        return [trainer.train_step(*b) for b in loader(tc, trainer.mesh, 0, args.steps, trainer.chain)]
    one = PipelineConfig(1, pipe.microbatches, "1F1B", 1)
    trainer = Trainer(Mesh((1,), ("pp",)), tc, pipe=one)
    dp, m, big = args.dp, pipe.microbatches, tc.batch_size
    order = torch.arange(big).reshape(dp, m, big // (dp * m)).transpose(0, 1).reshape(-1)
    return [trainer.train_step(*from_local_data(tuple(t.to_local()[order] for t in b), P(),
                                                trainer.mesh))
            for b in loader(tc, trainer.mesh, 0, args.steps, trainer.chain)]


def _reference_pipe(args, tc: TrainConfig) -> PipelineConfig | None:
    """The pipeline the reference must run to draw a pipelined run's dropout numbers."""
    pipe = pipe_config(args)
    return pipe if pipe is not None and tc.model.dropout > 0 else None


def update_metrics(run_dir: str, start: int, rows: list) -> list:
    """metrics.csv: the rows of the steps before ``start`` (from the runs this one
    resumed), then this run's."""
    path = os.path.join(run_dir, "metrics.csv")
    old = []
    if start > 0 and os.path.exists(path):
        with open(path) as f:
            old = [(int(r["step"]), float(r["loss"]), float(r["tokens_per_s"]), r["mesh"])
                   for r in csv.DictReader(f) if int(r["step"]) < start]
    allrows = old + rows
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss", "tokens_per_s", "mesh"])
        w.writerows(allrows)
    return allrows


def cached_reference(args, tc: TrainConfig) -> list:
    from sharded import launch

    path = os.path.join(args.run_dir, "reference.json")
    pipe = _reference_pipe(args, tc)
    # a pipelined run with dropout draws per micro-batch (see ``reference``)
    key = json.dumps({**tc.as_dict(), **({} if pipe is None else {
        "pipeline.microbatches": pipe.microbatches, "pipeline.dp": args.dp})}, sort_keys=True)
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        if saved.get("config") == key and len(saved["losses"]) >= args.steps:
            return saved["losses"][: args.steps]
    print(f"single-device reference: {args.steps} steps on one process ...", flush=True)
    # Under torchrun this process still has torchrun's variables; the new process must
    # not join torchrun's rendezvous (TORCHELASTIC_USE_AGENT_STORE) but start its own.
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("TORCHELASTIC_")}
    try:
        losses = launch(reference, 1, args, tc)[0]
    finally:
        os.environ.update(saved)
    with open(path, "w") as f:
        json.dump({"config": key, "losses": losses}, f)
    return losses


def plot(run_dir: str, rows: list, ref: list | None, entropy: float) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(pip install -e '.[examples]' for the loss-curve PNG)")
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    segments: list = []
    for step, loss, _, mesh in rows:
        if not segments or segments[-1][0] != mesh or step != segments[-1][1][-1] + 1:
            segments.append((mesh, [], []))
        segments[-1][1].append(step)
        segments[-1][2].append(loss)
    for i, (mesh, steps, losses) in enumerate(segments):
        ax.plot(steps, losses, lw=2, alpha=0.8, label=f"pjit, mesh {mesh}")
        if i:
            ax.axvline(steps[0] - 0.5, color="gray", ls=":", lw=1)
            ax.annotate("resumed", (steps[0], max(losses)), fontsize=8, color="gray")
    if ref is not None:
        ax.plot(range(len(ref)), ref, "k--", lw=1, label="single device")
    ax.axhline(entropy, color="tab:green", ls=":", lw=1, label=f"data entropy ({entropy:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("GPT with dropout under pjit, checkpointed and resumed, vs one device")
    ax.legend()
    fig.tight_layout()
    out = os.path.join(run_dir, "loss.png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def report(args, tc: TrainConfig, start: int, rows: list) -> None:
    """Rank 0 / the launcher: metrics, the reference comparison and the plot."""
    allrows = update_metrics(args.run_dir, start, rows)
    if not allrows:
        return
    ref = None if args.no_reference else cached_reference(args, tc)
    if ref is not None:
        diffs = [abs(loss - ref[s]) for s, loss, _, _ in allrows if s < len(ref)] or [0.0]
        print(f"max |pjit - single device| loss difference over {len(diffs)} steps: "
              f"{max(diffs):.2e}")
    png = plot(args.run_dir, allrows, ref, markov_chain(tc)[2])
    last = allrows[-1]
    print(f"final loss {last[1]:.4f} at step {last[0]} (data entropy "
          f"{markov_chain(tc)[2]:.4f}); metrics: {os.path.join(args.run_dir, 'metrics.csv')}"
          + (f"; plot: {png}" if png else ""))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=2, help="ranks along the data-parallel axis")
    ap.add_argument("--tp", type=int, default=2, help="ranks along the tensor-parallel axis")
    ap.add_argument("--pp", type=int, default=1,
                    help="ranks along the pipeline axis 'pp', in front of the mesh (world size "
                         "pp * dp * tp; --pp 2 with the default --dp 2 --tp 2 starts 8 ranks)")
    ap.add_argument("--microbatches", type=int, default=None,
                    help="micro-batches per step with --pp > 1 (default: 2 * pp); each 'dp' "
                         "rank's rows must split into them")
    ap.add_argument("--pp-schedule", choices=("GPipe", "1F1B", "Interleaved1F1B"), default="1F1B",
                    help="the pipeline schedule (Interleaved1F1B needs --virtual-stages >= 2)")
    ap.add_argument("--virtual-stages", type=int, default=1,
                    help="stages per pp rank (Interleaved1F1B); pp * virtual stages <= --layers")
    ap.add_argument("--plan", choices=sorted(gm.PLANS), default="sp")
    ap.add_argument("--dp-sharding", choices=("shard", "replicate"), default="shard",
                    help="FSDP-like (shard) or DDP-like (replicate) over 'dp'")
    ap.add_argument("--steps", type=int, default=200, help="train until this step")
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--async-ckpt", action="store_true", help="write checkpoints in the background")
    ap.add_argument("--run-dir", default="runs/gpt_train")
    ap.add_argument("--resume", action="store_true", help="continue from <run-dir>/checkpoint")
    ap.add_argument("--no-reference", action="store_true", help="skip the single-device run")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3, help="the (peak) learning rate")
    ap.add_argument("--schedule", choices=("constant", "cosine"), default="constant",
                    help="cosine: linear warmup over --warmup steps, then cosine decay to lr/10 at --decay-steps")
    ap.add_argument("--warmup", type=int, default=0)
    ap.add_argument("--decay-steps", type=int, default=200)
    ap.add_argument("--clip", type=float, default=0.0, help="clip gradients to this global norm (0: off)")
    ap.add_argument("--bf16", action="store_true",
                    help="compute in bf16 with fp32 master weights and fp32 gradient reductions")
    ap.add_argument("--remat", choices=("none", "block", "dots"), default="none",
                    help="recompute each block's activations in the backward (dots: keep matmul outputs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=64)
    args = ap.parse_args(argv)
    tc = TrainConfig(
        model=gm.Config(vocab=args.vocab, d_model=args.d_model, n_heads=args.heads,
                        n_layers=args.layers, seq=args.seq, dropout=args.dropout),
        batch_size=args.batch_size, lr=args.lr, schedule=args.schedule, warmup=args.warmup,
        decay_steps=args.decay_steps, clip=args.clip, bf16=args.bf16, seed=args.seed)
    return args, tc


def pipe_config(args) -> PipelineConfig | None:
    """The pipeline of ``--pp`` > 1 (None: the loss is not pipelined)."""
    if args.pp <= 1:
        return None
    m = args.microbatches or 2 * args.pp
    return PipelineConfig(args.pp, m, args.pp_schedule, args.virtual_stages)


def main(argv=None) -> None:
    args, tc = parse_args(argv)
    os.makedirs(args.run_dir, exist_ok=True)
    if "RANK" in os.environ:           # under torchrun: this process is one rank
        start, rows = train(args, tc)
        if int(os.environ["RANK"]) == 0:
            report(args, tc, start, rows)
    else:                              # laptop path: start pp * dp * tp local CPU ranks
        from sharded import launch

        start, rows = launch(train, args.pp * args.dp * args.tp, args, tc)[0]
        report(args, tc, start, rows)


if __name__ == "__main__":
    main()
