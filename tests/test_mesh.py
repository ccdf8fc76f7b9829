"""Mesh on GPUs with CUDA mocked out, in one process: each rank runs on its LOCAL_RANK
device when NCCL starts (NOTE [One GPU per rank] in sharded/mesh.py)."""

import types

import pytest
import torch
import torch.distributed as dist

from sharded import Mesh
from sharded import mesh as mesh_mod


class FakeCuda:
    """torch.cuda's device state for a process that sees ``count`` devices."""

    def __init__(self, monkeypatch, count: int, *, current: int | None = None):
        self.count = count
        self.current = 0 if current is None else current
        self.initialized = current is not None
        self.set_calls: list[int] = []
        for name in ("is_available", "device_count", "current_device", "set_device",
                     "is_initialized"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))

    def is_available(self):
        return self.count > 0

    def device_count(self):
        return self.count

    def is_initialized(self):
        return self.initialized

    def current_device(self):
        self.initialized = True              # torch.cuda.current_device() initialises CUDA
        return self.current

    def set_device(self, device):
        if not 0 <= device < self.count:
            raise RuntimeError("CUDA error: invalid device ordinal")
        self.set_calls.append(device)
        self.current, self.initialized = device, True


@pytest.mark.parametrize("local_rank, count, device", [
    (0, 1, 0), (0, 8, 0), (1, 2, 1), (7, 8, 7),
    (1, 1, 0), (3, 1, 0),                  # CUDA_VISIBLE_DEVICES gives each process one device
])
def test_device_of_a_local_rank(local_rank, count, device):
    assert mesh_mod._local_cuda_device(local_rank, count) == device


def test_more_ranks_than_devices_is_an_error(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=2 but its process sees only 2 CUDA "
                       r"devices \(CUDA_VISIBLE_DEVICES='0,1'\).*--nproc-per-node 2"):
        mesh_mod._local_cuda_device(2, 2, "Mesh(4,)")
    with pytest.raises(RuntimeError, match="sees no CUDA device"):
        mesh_mod._local_cuda_device(0, 0)


def test_sets_the_local_rank_device_when_cuda_is_not_initialised(monkeypatch):
    cuda = FakeCuda(monkeypatch, 4)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert mesh_mod._use_local_cuda_device() == 2
    assert cuda.set_calls == [2] and cuda.current == 2


def test_one_visible_device_per_process_is_device_0(monkeypatch):
    cuda = FakeCuda(monkeypatch, 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert mesh_mod._use_local_cuda_device() == 0
    assert cuda.set_calls == [0]


def test_already_on_the_local_rank_device(monkeypatch):
    cuda = FakeCuda(monkeypatch, 2, current=1)       # e.g. sharded.launch set it
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert mesh_mod._use_local_cuda_device() == 1
    assert cuda.set_calls == []


def test_cuda_initialised_on_another_device_is_an_error(monkeypatch):
    cuda = FakeCuda(monkeypatch, 2, current=0)       # a tensor made on "cuda" first
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(RuntimeError, match=r"Mesh\(2,\): this rank \(LOCAL_RANK=1\) must run on "
                       r"cuda:1, but CUDA was initialised before the mesh with cuda:0") as e:
        mesh_mod._use_local_cuda_device("Mesh(2,)")
    assert "torch.cuda.set_device(int(os.environ['LOCAL_RANK']))" in str(e.value)
    assert cuda.set_calls == [] and cuda.current == 0


def test_without_local_rank_the_device_is_the_callers(monkeypatch):
    cuda = FakeCuda(monkeypatch, 2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert mesh_mod._use_local_cuda_device() is None
    assert cuda.set_calls == [] and not cuda.initialized
    monkeypatch.setenv("LOCAL_RANK", "one")
    with pytest.raises(ValueError, match="LOCAL_RANK must be an int; got 'one'"):
        mesh_mod._use_local_cuda_device()


def _torchrun_env(monkeypatch, local_rank: int):
    """A process group not yet started, torchrun's variables for rank ``local_rank`` of
    2; init_process_group records the backend and the device current when it ran."""
    for k, v in dict(RANK=str(local_rank), WORLD_SIZE="2", LOCAL_RANK=str(local_rank),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT="29500").items():
        monkeypatch.setenv(k, v)
    started: list = []
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(started))
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(mesh_mod.atexit, "register", lambda fn: fn)
    return started


def test_mesh_starting_nccl_sets_the_device_first(monkeypatch):
    cuda = FakeCuda(monkeypatch, 2)
    started = _torchrun_env(monkeypatch, 1)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend: started.append((backend, cuda.current, cuda.set_calls[:])))
    mesh_mod._ensure_process_group((2,), None)
    assert started == [("cpu:gloo,cuda:nccl", 1, [1])]


def test_mesh_refuses_to_start_nccl_on_another_ranks_device(monkeypatch):
    FakeCuda(monkeypatch, 2, current=0)
    started = _torchrun_env(monkeypatch, 1)
    monkeypatch.setattr(dist, "init_process_group", lambda backend: started.append(backend))
    with pytest.raises(RuntimeError, match=r"Mesh\(2,\): this rank \(LOCAL_RANK=1\) must run on cuda:1"):
        mesh_mod._ensure_process_group((2,), None)
    assert started == []                  # NCCL never started


def test_mesh_without_cuda_starts_gloo_and_leaves_cuda_alone(monkeypatch):
    cuda = FakeCuda(monkeypatch, 0)
    started = _torchrun_env(monkeypatch, 1)
    monkeypatch.setattr(dist, "init_process_group", lambda backend: started.append(backend))
    mesh_mod._ensure_process_group((2,), None)
    assert started == ["gloo"] and cuda.set_calls == []


class _Stop(Exception):
    pass


def test_a_cuda_mesh_sets_the_device_before_the_device_mesh(monkeypatch):
    """A process group already running (sharded.launch, or the caller's): building a
    CUDA mesh still puts the rank on its device before DeviceMesh's set-up."""
    cuda = FakeCuda(monkeypatch, 2)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    seen = []

    def init_device_mesh(device_type, shape, mesh_dim_names):
        seen.append((device_type, cuda.current, cuda.set_calls[:]))
        raise _Stop                    # no CUDA DeviceMesh on this machine: stop here

    monkeypatch.setattr(mesh_mod, "init_device_mesh", init_device_mesh)
    with pytest.raises(_Stop):
        Mesh((1,), ("x",), device_type="cuda")
    assert seen == [("cuda", 1, [1])]


def test_mesh_device(monkeypatch):
    FakeCuda(monkeypatch, 2, current=1)
    assert Mesh.device.fget(types.SimpleNamespace(device_type="cuda", _abstract_rank=None)) \
        == torch.device("cuda", 1)
    assert Mesh.device.fget(types.SimpleNamespace(device_type="cuda", _abstract_rank=0)) \
        == torch.device("cuda")
    assert Mesh((1,), ("x",)).device == torch.device("cpu")
