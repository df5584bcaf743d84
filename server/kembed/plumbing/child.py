"""What the supervisor's children (the engine and each front end) do alike: SIGTERM starts their
drain, ^C is the supervisor's to handle, they exit when the supervisor is gone, and once serving they
keep what they loaded out of the garbage collector's sight."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import Callable

from kembed.contract import EXIT_FATAL

log = logging.getLogger(__name__)


class Child:
    def __init__(self) -> None:
        self._parent = os.getppid()
        self.stop = asyncio.Event()  # set by SIGTERM, from the supervisor

    def handle_signals(self) -> None:
        """Call on the running loop: SIGTERM sets ``stop``; SIGINT is ignored, since a terminal's ^C
        reaches the whole process group and the supervisor turns it into the same drain."""
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self.stop.set)
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    async def tick(self, every_s: float, beat: Callable[[], None]) -> None:
        """``beat`` every ``every_s`` seconds (a heartbeat, refreshed figures); exit if the supervisor
        is gone, since nobody would stop this process any more."""
        while True:
            beat()
            if os.getppid() != self._parent:
                log.critical("the supervisor is gone: exiting")
                os._exit(EXIT_FATAL)
            await asyncio.sleep(every_s)

    @staticmethod
    def freeze_heap() -> None:
        """What is loaded now lives as long as the process: out of the collector's sight, so full
        collections stop walking it between requests."""
        gc.collect()
        gc.freeze()
