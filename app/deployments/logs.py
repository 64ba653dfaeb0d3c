"""The replicas' logs: the project's own records in them, client errors as one warning line.

The project's loggers (`app.*`: the engine's start-up by phase, KV cache size, CUDA graphs) write
through Ray Serve's handlers of the replica, so their INFO records reach the replica's log file
and `serve run`'s output like Serve's own (without this they went nowhere: a replica's root
logger passes only warnings).

Ray Serve logs every exception a replica method raises as "Request failed." with its traceback
(`logger.exception` on the "ray.serve" logger), which makes a client's mistake (a prompt too long,
a token id outside the vocabulary, a bad sampling parameter) look like a replica error. The
caller still gets the typed exception; only the log record changes: `install()` adds a filter
that turns those records, when the exception is a client error, into one WARNING line naming it.
"""

from __future__ import annotations

import logging

from app.deployments.protocol import OpenAIError
from app.engine.errors import InvalidRequestError

SERVE_LOGGER = "ray.serve"
PROJECT_LOGGER = "app"


def is_client_error(e: BaseException | None) -> bool:
    return isinstance(e, InvalidRequestError) or (isinstance(e, OpenAIError) and e.status_code < 500)


class ClientErrorsAsWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        e = record.exc_info[1] if record.exc_info else None
        if is_client_error(e) and record.getMessage() == "Request failed.":
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg, record.args = f"request refused ({type(e).__name__}): {e}", ()
            record.exc_info, record.exc_text = None, None
        return True


def install() -> None:
    """Idempotent: at most one filter on the Serve logger of this process, and the project's
    logger writes through the Serve logger's handlers (once)."""
    logger = logging.getLogger(SERVE_LOGGER)
    if not any(isinstance(f, ClientErrorsAsWarnings) for f in logger.filters):
        logger.addFilter(ClientErrorsAsWarnings())
    project = logging.getLogger(PROJECT_LOGGER)
    if logger.handlers and not project.handlers:
        for handler in logger.handlers:
            project.addHandler(handler)
        project.setLevel(logging.INFO)
        project.propagate = False
