"""Pipeline parallelism over a mesh axis (docs/pipeline.md): ``pipeline(loss_fn, ...)``
inside a train step, ``pipe_split`` at the stage boundaries."""

from sharded.pipelining._api import pipe_split, pipeline

__all__ = ["pipeline", "pipe_split"]
