"""Finding a model's attached slots without the table: NOTE [hidden requests] in model_process.

A request is found by its table row, and any client can rewrite any row -- also a new client's,
before the model process has ever seen its token. Then the only other record of the slot is its
segment file in the namespace directory, ``<model>.s<slot>.<token>``. Any client can also fill
that directory with names, so it is listed by a thread, when asked, at most once per
``interval`` seconds (and 20 times as long as the last listing took), opening at most
``per_look`` candidates each time and never one that failed before: what a flood of names costs
lands on this thread, a bounded share of a core (about 5%), never on the serving thread -- which keeps only handles with a request waiting, a few per pass.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
from typing import Callable, FrozenSet, List, Optional

from .slots import Peer

logger = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^(\d{1,9})\.([0-9a-f]{16})$")   # <slot>.<token>, after "<model>.s"


class SlotFinder:
    """Lists ``directory`` for the segments of ``model``'s slots and opens them as Peers."""

    def __init__(self, namespace: str, directory: str, model: str, max_slots: int,
                 interval: float = 1.0, per_look: int = 256, found: Optional[Callable[[], None]] = None):
        self.namespace, self.directory, self.model = namespace, directory, model
        self._on_found = found   # called (on this thread) after a look that opened something
        self.max_slots, self.interval, self.per_look = max_slots, interval, per_look
        self._prefix = f"{model}.s"
        self._asked = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._known: FrozenSet[tuple] = frozenset()
        self._found: List[Peer] = []
        self._failed: set = set()    # names that did not open as a slot (bounded, see _look)
        self._thread: Optional[threading.Thread] = None

    def ask(self, known: FrozenSet[tuple]) -> None:
        """Look soon for slots other than ``known`` ((slot, token) pairs I have handles on)."""
        with self._lock:
            self._known = known
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="simpledbi-slot-finder", daemon=True)
            self._thread.start()
        self._asked.set()

    def take(self) -> List[Peer]:
        """The slots found since the last call, opened (the caller owns them now)."""
        with self._lock:
            found, self._found = self._found, []
        return found

    def close(self) -> None:
        self._stop.set()
        self._asked.set()
        if self._thread is not None:
            self._thread.join(5)
        for peer in self.take():
            peer.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._asked.wait()
            if self._stop.is_set():
                return
            self._asked.clear()
            t0 = time.monotonic()
            try:
                self._look()
            except Exception:  # noqa: BLE001 - a failed look only delays the next one
                logger.debug("listing the namespace directory failed", exc_info=True)
            # The rate limit: at least ``interval``, and 20 times what the look took -- a
            # directory a client filled with names costs this thread at most ~5% of a core.
            self._stop.wait(max(self.interval, 20 * (time.monotonic() - t0)))

    def _look(self) -> None:
        with self._lock:
            known = self._known
        if len(self._failed) > 64 * self.max_slots:
            self._failed.clear()
        opened, tried = [], 0
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if self._stop.is_set() or tried >= self.per_look:
                    break
                name = entry.name
                if not name.startswith(self._prefix) or name in self._failed:
                    continue
                m = _NAME_RE.match(name[len(self._prefix):])
                if m is None:
                    continue
                slot, token = int(m.group(1)), int(m.group(2), 16)
                if slot >= self.max_slots or (slot, token) in known:
                    continue
                tried += 1
                try:
                    opened.append(Peer(self.namespace, self.model, slot, token))
                except OSError as e:
                    if e.errno in (errno.EMFILE, errno.ENFILE):
                        break   # out of descriptors: not this name's fault, try again next look
                    self._failed.add(name)
                except Exception:  # noqa: BLE001 - not a slot (gone, a fake, not a regular file)
                    self._failed.add(name)
        if opened:
            with self._lock:
                self._found.extend(opened)
            if self._on_found is not None:
                self._on_found()
