"""Automatic sharding: ``AUTO`` specs decided by a solver (docs/auto.md).

- ``CostModel``: seconds of compute and communication on one kind of machine
  (measured on a mesh at first use and cached, or the stated H100 table);
- ``predict(lowered)``: the predicted step time of any lowered pjit program.

The decide step itself (sharded/auto/_decide.py) runs inside pjit's lowering.
"""

from sharded.auto.cost import CostModel, predict

__all__ = ["CostModel", "predict"]
