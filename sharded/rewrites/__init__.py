"""Rewrites of a traced program that change what it computes, not how its values are
laid out: the loss rewrites (``losses.py``). The random rewrite lives with the
counter-based RNG (``sharded/random/rewrite.py``)."""
