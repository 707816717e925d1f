"""Offline calibration: what this machine measures. :func:`calibrate` times each copy method and direction
and one prefill layer (``local.py``); ``network.py`` and ``disk.py`` measure the network link to a peer and a
disk store (``kvcopy calibrate --remote`` / ``--disk``); ``fit.py`` fits ``t = alpha + bytes / beta``,
``timing.py`` times calls, ``machine.py`` names the machine a result came from."""

from __future__ import annotations

from kvcopy.calibration.local import calibrate

__all__ = ["calibrate"]
