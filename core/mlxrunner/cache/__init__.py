"""Caches that snapshot and restore, so any mix of layer kinds can be rolled back, and that
stand in for themselves inside a traced forward (see :mod:`.frame`)."""

from .base import Cache
from .frame import TraceFrame, Untraceable
from .kv import KVCache
from .recurrent import RecurrentCache, StateCapture
from .ring import RingCache

__all__ = ["Cache", "KVCache", "RecurrentCache", "RingCache", "StateCapture", "TraceFrame",
           "Untraceable"]
