"""Pipeline parallelism over a mesh axis (docs/pipeline.md): ``pipeline(loss_fn, ...)``
inside a train step, ``pipe_split`` at the stage boundaries."""

from sharded.pipelining._api import pipe_split, pipeline
from sharded.pipelining._runtime import last_timeline
from sharded.pipelining._split import PipelineError

__all__ = ["pipeline", "pipe_split", "last_timeline", "PipelineError"]
