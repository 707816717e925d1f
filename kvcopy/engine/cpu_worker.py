"""What a TransferEngine's CPU worker runs for one transfer: wait for the transfers it must follow, copy
(layer by layer, signalling each, for a layer-wise reload), stamp the times, report, signal."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from kvcopy.engine.transfer import ThreadSignal, Transfer

__all__ = ["cpu_copy_job"]


def cpu_copy_job(
    copy: Callable[[int | None], None],
    num_layers: int,
    after: list[Transfer],
    transfer: Transfer,
    done: ThreadSignal,
    layers: list[ThreadSignal] | None,
    stamps: list[float],
) -> Callable[[], None]:
    """The job: ``copy(layer)`` copies one layer (None: all of them); ``stamps`` holds the submission time
    and gets the copy's start and end; an error goes to every signal not yet set, and is not reported."""

    def run() -> None:
        for earlier in after:  # the other worker's transfers that touch these blocks (failed ones count as done)
            with contextlib.suppress(Exception):
                earlier.wait()
        stamps.append(time.perf_counter())
        try:
            if layers:
                for layer in range(num_layers):
                    copy(layer)
                    layers[layer].set()
            else:
                copy(None)
        except BaseException as err:  # handed to whoever waits
            for signal in layers or []:
                if not signal.query():
                    signal.set(err)
            done.set(err)
            return
        stamps.append(time.perf_counter())
        transfer.report()  # here, before done: an observer such as OnlineProfile.observe_copy takes no lock
        done.set()

    return run
