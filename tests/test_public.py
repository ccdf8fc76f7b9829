"""The public surface (issue 23): pjit and shard_map import from sharded, the
exceptions users catch live in sharded.errors, ``sharded.launch`` is the module and
calls ``launch``, and a user's own ``transforms.py`` cannot shadow the library."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import sharded
import sharded.errors
import transforms


def test_pjit_and_shard_map_import_from_sharded_and_transforms_reexports_them():
    from sharded import Lowered, UNSPECIFIED, pjit, shard_map

    assert transforms.pjit is pjit and transforms.shard_map is shard_map
    assert transforms.Lowered is Lowered and transforms.UNSPECIFIED is UNSPECIFIED
    assert transforms.TracingError is sharded.errors.TracingError


def test_exceptions_are_one_class_each_wherever_they_are_imported_from():
    from sharded import checkpoint, launch, sync
    from sharded import _trace
    from sharded.modes import ShardingRuleError

    e = sharded.errors
    assert sync.RankMismatchError is e.RankMismatchError is sharded.RankMismatchError
    assert sync.RankFailedError is e.RankFailedError is sharded.RankFailedError
    assert _trace.TracingError is e.TracingError and _trace.CapturedStateError is e.CapturedStateError
    assert checkpoint.CheckpointError is e.CheckpointError is sharded.CheckpointError
    assert ShardingRuleError is e.ShardingRuleError and launch.RankError is e.RankError
    for name in e.__all__:
        assert issubclass(getattr(e, name), Exception) and getattr(sharded, name) is getattr(e, name)


def test_sharded_launch_is_the_module_and_calls_launch():
    import importlib

    module = importlib.import_module("sharded.launch")
    assert sharded.launch is module and module.RankPool is sharded.RankPool
    assert callable(sharded.launch)
    assert sharded.launch(_rank_times_ten, 2) == [0, 10]


def _rank_times_ten():
    import torch.distributed as dist

    return dist.get_rank() * 10


def test_a_users_transforms_module_does_not_shadow_sharded(tmp_path):
    """A user's project with its own transforms.py (a common name) imports sharded
    and pjits a function: sharded never imports the top-level transforms package."""
    (tmp_path / "transforms.py").write_text("raise ImportError('the user transforms.py was imported')\n")
    (tmp_path / "main.py").write_text(textwrap.dedent("""
        import torch
        from sharded import Mesh, P, pjit, shard_map
        mesh = Mesh.abstract((2,), ("dp",))
        lowered = pjit(lambda x: x * 2, in_specs=P("dp"), mesh=mesh).lower(torch.ones(4))
        print(lowered.in_specs)
    """))
    done = subprocess.run([sys.executable, "main.py"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "PartitionSpec('dp',)" in done.stdout or "P('dp')" in done.stdout, done.stdout
