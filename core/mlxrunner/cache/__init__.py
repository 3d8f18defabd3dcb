"""Caches that snapshot and restore, so any mix of layer kinds can be rolled back, and that
stand in for themselves inside a traced forward (see :mod:`.frame`)."""

from .base import Cache
from .batched import BatchCaches, BatchedCache, RowFrame, SoloCaches
from .frame import TraceFrame, Untraceable, active_frame, bucket_capacity, framing
from .kv import KVCache
from .prefix import PrefixCache, PrefixHit, default_prefix_budget, prefix_cache_for, scaled_budget
from .recurrent import RecurrentCache, StateCapture
from .ring import RingCache

__all__ = ["BatchCaches", "BatchedCache", "Cache", "KVCache", "PrefixCache", "PrefixHit",
           "RecurrentCache", "RingCache", "RowFrame", "SoloCaches", "StateCapture",
           "TraceFrame", "Untraceable", "active_frame", "bucket_capacity",
           "default_prefix_budget", "framing", "prefix_cache_for", "scaled_budget"]
