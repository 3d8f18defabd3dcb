"""Caches that snapshot and restore, so any mix of layer kinds can be rolled back."""

from .base import Cache
from .kv import KVCache
from .recurrent import RecurrentCache
from .ring import RingCache

__all__ = ["Cache", "KVCache", "RecurrentCache", "RingCache"]
