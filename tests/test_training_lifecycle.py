"""training/lifecycle.py: `StopSignals` (the first SIGTERM / SIGINT / SIGHUP asks for a stop, a repeat within 3 s is
the same request). The run lock, the watchdog and whole-trainer stops are in tests/test_lifecycle.py."""

from __future__ import annotations

import os

import pytest

from training.lifecycle import StopSignals


# ---------------------------------------------------------------------------------------------------------------
# stop signals
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("first", ["SIGTERM", "SIGHUP"])
def test_stop_signals_first_asks_repeat_within_3s_is_the_same_request(first):
    """A scheduler's SIGTERM and a closed terminal's SIGHUP both ask for a stop with a checkpoint; a repeat within
    3 s (torchrun's forwarded copy) changes nothing."""
    import signal

    first = getattr(signal, first)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        stop = StopSignals(announce=False).install()
        os.kill(os.getpid(), first)
        assert stop.signum == first
        os.kill(os.getpid(), signal.SIGINT)  # torchrun's forwarded copy: no effect, the process lives on
        os.kill(os.getpid(), signal.SIGHUP)
        assert stop.signum == first
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
