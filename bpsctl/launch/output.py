"""Relaying a worker's output: line by line, prefixed with its rank, teed to its log file."""
from __future__ import annotations

import collections
import threading
from pathlib import Path
from typing import IO

from bpsctl.engine.common import DISK_FULL_ERRNOS

# One lock for every relay in the process, so lines of different ranks never interleave.
_WRITE_LOCK = threading.Lock()


class OutputRelay:
    """Relays one worker's stdout and stderr (two pipes) to our streams and to ``log_path``.

    Keeps the last ``tail_lines`` lines of both pipes for the root-cause report.
    """

    def __init__(self, rank: int, stdout_pipe: IO[bytes], stderr_pipe: IO[bytes],
                 out: IO[str], err: IO[str], log_path: Path, tail_lines: int = 20,
                 prefix: str | None = None):
        self.prefix = prefix if prefix is not None else f"[{rank}] "
        self._tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        # unbuffered, so each line is one write() and lines of the two pipes stay whole
        self._log = open(log_path, "wb", buffering=0)
        self._log_path = log_path
        self._lost = 0              # lines the log missed since the disk under it filled
        self._threads = [
            threading.Thread(target=self._relay, args=(stdout_pipe, out), daemon=True,
                             name=f"relay-{rank}-stdout"),
            threading.Thread(target=self._relay, args=(stderr_pipe, err), daemon=True,
                             name=f"relay-{rank}-stderr"),
        ]
        for thread in self._threads:
            thread.start()

    def _relay(self, pipe: IO[bytes], stream: IO[str]) -> None:
        with pipe:
            for raw_line in iter(pipe.readline, b""):
                if not raw_line.endswith(b"\n"):
                    raw_line += b"\n"
                line = raw_line.decode("utf-8", errors="replace")
                with _WRITE_LOCK:
                    said = self._to_log(raw_line)
                    self._tail.append(line.rstrip("\n"))
                    try:
                        if said:
                            stream.write(self.prefix + said + "\n")
                        stream.write(self.prefix + line)
                        stream.flush()
                    except (OSError, ValueError):
                        pass    # our own stdout is gone (closed pipe): keep draining, keep the log

    def _to_log(self, raw_line: bytes) -> str:
        """Write a line to the log file; what to tell our stream once when the disk under the
        log is full (the worker's output goes on there, so training does not wait on the
        disk), else "". The first line written once there is room again says how many the
        log is missing."""
        if self._log.closed:            # close() may have given up waiting for us
            return ""
        try:
            if self._lost:
                self._log.write(f"[bpsctl] {self._lost} line(s) of this log were lost: its "
                                "disk was full\n".encode())
            self._log.write(raw_line)
            self._lost = 0
            return ""
        except OSError as exc:
            if exc.errno not in DISK_FULL_ERRNOS:
                raise
            self._lost += 1
            if self._lost > 1:
                return ""
            return (f"[bpsctl] cannot write {self._log_path}: {exc.strerror}; this worker's "
                    "output goes on here only until there is room")

    def close(self, timeout_s: float = 2.0) -> None:
        """Wait for both pipes to reach end of file (the worker's group has exited), then close."""
        for thread in self._threads:
            thread.join(timeout_s)
        with _WRITE_LOCK:
            self._log.close()

    def last_lines(self) -> list[str]:
        with _WRITE_LOCK:
            return list(self._tail)
