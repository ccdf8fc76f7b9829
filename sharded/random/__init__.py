"""Random numbers that do not depend on the mesh.

Inside functions traced by pjit, torch's random ops (rand, randn, randint and their
_like forms, bernoulli, dropout, uniform_, normal_) draw from a counter-based
generator (Philox4x32-10): the element with global linear index ``i`` of a program's
draw ``d`` is ``Philox(seed, offset + d, i)``. Every element has the value it has in
the single-device program, whatever the mesh and the layout, with no communication.

The state is (seed, offset), explicit and process-wide: ``manual_seed`` sets it on
every rank; otherwise the seed is taken from rank 0's ``torch.initial_seed()`` the
first time a program needs it. Each call of a program with ``k`` random ops advances
the offset by ``k``. ``get_rng_state``/``set_rng_state`` save and restore it, so a
resumed run draws what it would have drawn.
"""

from __future__ import annotations

from typing import Any

import torch

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


def _agree_on_seed(mesh) -> None:
    """Take the seed from rank 0 unless one is set (collective over the mesh)."""
    if _STATE["seed"] is not None:
        return
    seed = torch.initial_seed() % 2**63
    if mesh.size() > 1:
        from sharded.sync import all_gather_objects

        seed = all_gather_objects(seed, mesh.sync_group())[0]
    _STATE["seed"] = seed


def _take(n_draws: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(seed, offset) tensors for one call of a program with ``n_draws`` draws."""
    seed, offset = _STATE["seed"], _STATE["offset"]
    _STATE["offset"] = offset + n_draws
    return (torch.tensor(seed, dtype=torch.int64, device=device),
            torch.tensor(offset, dtype=torch.int64, device=device))
