"""Random numbers that do not depend on the mesh.

Inside functions traced by pjit, torch's random ops (rand, randn, randint and their
_like forms, bernoulli, dropout, uniform_, normal_) draw from a counter-based
generator (Philox4x32-10): the element with global linear index ``i`` of a program's
draw ``d`` is ``Philox(seed, offset + d, i)``. Every element has the value it has in
the single-device program, whatever the mesh and the layout, with no communication.

The state is (seed, offset), explicit and process-wide: ``manual_seed`` sets it on
every rank; otherwise the seed is taken from rank 0's ``torch.initial_seed()`` the
first time a program needs it. The ranks compare their (seed, offset) before every
call of a program that draws (pjit's cross-rank agreement): a rank that set another
seed, or none while the others did, is an error on every rank, not a hang and not
different numbers. Each call of a program with ``k`` random ops advances
the offset by ``k``. ``get_rng_state``/``set_rng_state`` save and restore it, so a
resumed run draws what it would have drawn.
"""

from __future__ import annotations

from typing import Any

import torch

from sharded import sync
from sharded.random import philox
from sharded.random.philox import *  # noqa: F401,F403

__all__ = ["manual_seed", "get_rng_state", "set_rng_state", "philox"] + list(philox.__all__)

_STATE: dict[str, Any] = {"seed": None, "offset": 0}


def manual_seed(seed: int) -> None:
    """Seed the generator (call it with the same seed on every rank); resets the offset."""
    if not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"manual_seed expects an int in [0, 2**63); got {seed!r}.")
    _STATE["seed"], _STATE["offset"] = seed, 0


def get_rng_state() -> dict:
    """``{"seed": int | None, "offset": int}``: save it with a checkpoint."""
    return dict(_STATE)


def set_rng_state(state: dict) -> None:
    """Restore a state from ``get_rng_state`` (on every rank)."""
    if set(state) != {"seed", "offset"}:
        raise ValueError(f"set_rng_state expects a dict from get_rng_state; got keys {sorted(state)}.")
    _STATE["seed"], _STATE["offset"] = state["seed"], int(state["offset"])


def _call_state() -> tuple:
    """What this rank brings to a call's cross-rank agreement (sharded.sync.agree):
    ``(seed or None, offset, torch.initial_seed())``."""
    return (_STATE["seed"], _STATE["offset"], torch.initial_seed() % 2**63)


def _settle(states: list, api: str) -> None:
    """After a full exchange: ``states`` is every rank's ``_call_state()``. Ranks
    draw the same numbers only with the same (seed, offset): if no rank set a seed,
    all take rank 0's ``torch.initial_seed()``; any other difference is an error on
    every rank (the same decision everywhere, from the same list)."""
    seeds = [s[0] for s in states]
    if all(s is None for s in seeds):
        if len({s[1] for s in states}) == 1:
            _STATE["seed"] = states[0][2]
            return
    elif len({(s[0], s[1]) for s in states}) == 1:
        return
    table = ", ".join(f"rank {r}: seed {s[0]!r} offset {s[1]}" for r, s in enumerate(states))
    raise sync.RankMismatchError(
        f"{api}: the ranks' random states differ ({table}), so they would draw different "
        f"numbers for the same elements. Call sharded.random.manual_seed(seed) with the "
        f"same seed on every rank (or on none), and the same programs in the same order."
    )


def _agree_on_seed(mesh, api: str = "sharded.random") -> None:
    """Settle the seed and check that every rank of ``mesh`` has the same (seed,
    offset): a collective that every rank enters, whether its seed is set or not
    (eager random draws in a shard_map body; pjit folds the same check into its
    per-call agreement)."""
    states = sync.agree(mesh, api, sync.Outcome(0, list, _call_state()))
    if states is not None:
        _settle(states, api)


def _take(n_draws: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(seed, offset) tensors for one call of a program with ``n_draws`` draws."""
    seed, offset = _STATE["seed"], _STATE["offset"]
    _STATE["offset"] = offset + n_draws
    return (torch.tensor(seed, dtype=torch.int64, device=device),
            torch.tensor(offset, dtype=torch.int64, device=device))
