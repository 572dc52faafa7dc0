"""Scoring policies behind one interface: `policies.get(name, **kwargs)`.

Known names: full, random, streaming, h2o, snapkv, pyramidkv, tova, knorm, kvzip,
expected_attention, learned ("learned:<adapter dir or hub id>" loads a trained scorer).
"""

from sparsekv.policies import expected_attention as _expected_attention  # noqa: F401  (registers it)
from sparsekv.policies import heuristics as _heuristics  # noqa: F401  (registers the baselines)
from sparsekv.policies import kvzip as _kvzip  # noqa: F401  (registers "kvzip")
from sparsekv.policies import learned as _learned  # noqa: F401  (registers "learned")
from sparsekv.policies.base import Policy, ScoreContext, available, get, register

__all__ = ["Policy", "ScoreContext", "available", "get", "register"]
