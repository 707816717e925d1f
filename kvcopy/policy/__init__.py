"""kvcopy's judgment around the copies: the model a cache belongs to (ModelSpec), whether a saved cache is
valid for a request (CacheKey, BlockIndex), what this machine measures (calibrate, fits, timing), what the
engine measures while it serves (OnlineProfile) and what to do with a prefix (Planner). Depends on the copy
core; the core never imports it."""

from kvcopy.policy.online import OnlineProfile

__all__ = ["OnlineProfile"]
