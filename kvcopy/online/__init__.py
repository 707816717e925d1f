"""Learning an engine's costs while it serves: :class:`OnlineProfile`, a Profile recalibrated from the
engine's own transfers and forwards, with the offline calibration as its prior."""

from __future__ import annotations

from kvcopy.online.profile import OnlineProfile

__all__ = ["OnlineProfile"]
