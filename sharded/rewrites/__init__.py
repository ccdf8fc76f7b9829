"""Rewrites of a traced program that change what it computes, not how its values are
laid out: the loss rewrites (``losses.py``) and the identities dropped where keeping
them would cost a collective (``algebra.py``). The random rewrite lives with the
counter-based RNG (``sharded/random/rewrite.py``)."""
