"""gunicorn's logging, Freight's way: ``freight api`` runs gunicorn with ``--logger-class`` this.

gunicorn's own logger class gives its error and access logs handlers and formats of their own
(stderr and stdout), set up in the master, whose workers fork from it. This one sets up the
process's logging from FREIGHT_LOG_LEVEL and FREIGHT_LOG_FORMAT instead (``storage.logs``), and
lets gunicorn's two loggers write through that handler: the app's lines, gunicorn's and the
access lines are then in one format, in every process. An access line carries its request's id
(``api.request_ids``), written when the request is already done.
"""

from __future__ import annotations

import logging
from typing import Any

from gunicorn.glogging import Logger

from api.request_ids import ENVIRON_KEY
from storage.logs import bound, configure_settings
from storage.settings import Settings


class FreightLogger(Logger):
    def setup(self, cfg: Any) -> None:
        super().setup(cfg)  # computes whether access lines are wanted (--access-logfile)
        configure_settings(Settings.from_env())
        for log in (self.error_log, self.access_log):
            for handler in list(log.handlers):
                log.removeHandler(handler)
            log.propagate = True
            log.setLevel(logging.NOTSET)  # the root's level: FREIGHT_LOG_LEVEL

    def access(self, resp: Any, req: Any, environ: dict[str, Any], request_time: Any) -> None:
        with bound(request_id=environ.get(ENVIRON_KEY)):
            super().access(resp, req, environ, request_time)
