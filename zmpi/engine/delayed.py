"""The one-step delayed parameter update (DPU; Ren et al., ATC'21, Sec. 5.2).

After `delay_update_warmup` synchronous steps, the host Adam of step t runs in a background
thread while forward and backward of step t+1 run with the parameters of step t-1; the update
of step t lands, and its parameters are published, at the end of step t+1's backward.

    delayed.start(step_fn, step)   run step_fn() (the optimizer step) in a thread
    delayed.wait()                 join it and raise its error; its result is then unpublished
    delayed.unpublished            a landed update whose parameters are not published yet
"""
from __future__ import annotations

import threading
import time


class DelayedUpdate:
    """The update in flight (at most one) and whether a landed one awaits publication.
    `timing` (the engine's update_timing) gets the optimizer's and the waits' seconds."""

    def __init__(self, timing: dict):
        self.timing = timing
        self.thread = None  # the update in flight
        self._outcome = {}
        self.unpublished = False

    def start(self, step_fn, step: int) -> None:
        outcome = {"step": step}

        def run():
            start = time.perf_counter()
            try:
                step_fn()
            except BaseException as e:  # handed to the training thread by wait()
                outcome["error"] = e
            self.timing["optimizer_s"] += time.perf_counter() - start

        self.thread, self._outcome = threading.Thread(target=run,
                                                      name="zmpi-delayed-update"), outcome
        self.thread.start()
        self.timing["delayed_steps"] += 1

    def wait(self) -> None:
        """Wait for the update in flight, if any, and raise its error; the parameters it
        produced stay unpublished until the engine publishes them."""
        if self.thread is None:
            return
        start = time.perf_counter()
        self.thread.join()
        self.timing["waited_s"] += time.perf_counter() - start
        self.thread, outcome = None, self._outcome
        if "error" in outcome:
            raise RuntimeError(f"the delayed optimizer step {outcome['step']} failed in its "
                               "background thread") from outcome["error"]
        self.unpublished = True
