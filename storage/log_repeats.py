"""A library's message said again and again is written once a minute, with a count of the rest.

vLLM logs some warnings per request, not once: on the CPU backend each image request's
multimodal processing logs "CPU backend doesn't allow to use `torch.set_num_threads` after the
thread binding, skip it." twice, so one batch of 2,000 image lines wrote 13,005 such lines to the
engine worker's log, on the engine thread, between engine steps (about a fifth of that thread's
time rendering image requests, measured in-process). Such a flood buries what the log is for and
costs the accelerator time.

``RepeatFilter`` (on the handler of every process, ``storage.logs.make_handler``) lets a record of
the engine's libraries (vLLM, torch, transformers) through when its message template has not been
written for ``every`` seconds; the next one written after that says how many were left out
meanwhile. Errors and worse always pass, as does every other logger's record: Freight's own lines
about each unit and batch, Celery's about each task, the API's about each request.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

REPEAT_SECONDS = 60.0
# the loggers thinned, with their children: the engine's libraries
THINNED = ("vllm", "torch", "transformers")
_MAX_TEMPLATES = 4096  # distinct templates remembered (least recently written forgotten first)


class RepeatFilter(logging.Filter):
    """See the module docstring. Thread-safe: a handler runs its filters outside its lock."""

    def __init__(self, every: float = REPEAT_SECONDS) -> None:
        super().__init__()
        self.every = every
        self._lock = threading.Lock()
        # (logger, level, template) -> (when one was last written, how many left out since)
        self._seen: OrderedDict[tuple[str, int, str], tuple[float, int]] = OrderedDict()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR or record.name.split(".", 1)[0] not in THINNED:
            return True
        key = (record.name, record.levelno, str(record.msg))
        with self._lock:
            last = self._seen.get(key)
            if last is not None and record.created - last[0] < self.every:
                self._seen[key] = (last[0], last[1] + 1)
                return False
            self._seen[key] = (record.created, 0)
            self._seen.move_to_end(key)
            if len(self._seen) > _MAX_TEMPLATES:
                self._seen.popitem(last=False)
        if last is not None and last[1]:
            # Freight's handler is the only one a deployment has for these loggers (vLLM's write
            # through it and do not propagate; torch's and transformers' reach it on the root), so
            # noting the count on the record changes no other output
            record.msg = f"{record.msg} [{last[1]} more like this in the last {record.created - last[0]:.0f} s not written]"
        return True
