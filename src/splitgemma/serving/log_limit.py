"""Rate limit for repeated identical log records: a flood of one message (a client opening thousands of connections,
a worker that keeps failing the same way) must not fill the disk or drown the rest of the log.

Records are identical when their logger, level, message and extra fields are: per-request records differ by their
request id and always pass. Of identical records, `burst` pass per `interval` seconds; the others are counted, and
the first one let through after them carries the count as its `suppressed` field.
"""

from __future__ import annotations

import logging
import time

# The attributes every LogRecord has: what is left are the `extra` fields.
STANDARD_ATTRS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class RepeatFilter(logging.Filter):
    def __init__(self, burst: int = 10, interval: float = 10.0, max_keys: int = 4096):
        super().__init__()
        self.burst = burst
        self.interval = interval
        self.max_keys = max_keys
        self._seen: dict[tuple, list] = {}     # key -> [window start, passed in window, suppressed since]

    def filter(self, record: logging.LogRecord) -> bool:
        extra = tuple(sorted((k, repr(v)) for k, v in vars(record).items() if k not in STANDARD_ATTRS))
        key = (record.name, record.levelno, record.getMessage(), extra)
        now = time.monotonic()
        entry = self._seen.get(key)
        if entry is None or now - entry[0] >= self.interval:
            suppressed = entry[2] if entry is not None else 0
            if entry is None and len(self._seen) >= self.max_keys:
                self._seen.clear()  # a bound on memory; forgetting only lets a few more records through
            self._seen[key] = [now, 1, 0]
            if suppressed:
                record.suppressed = suppressed
            return True
        if entry[1] < self.burst:
            entry[1] += 1
            return True
        entry[2] += 1
        return False
