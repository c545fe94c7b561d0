"""Opening shard URLs: local files, `pipe:CMD` and http(s) (through curl), with the exit status
checked and a stall timeout.

webdataset's `gopen` Pipe raises the command's exit status from inside `read()`, which escaped
`tarfile.open` as a bare OSError (or looked like an empty shard, depending on timing). Here a
command's stream is plain bytes; `finish()` says afterwards whether the command failed, and the
shard reader decides (retry, then count the shard as failed).
"""

from __future__ import annotations

import contextlib
import os
import select
import shlex
import signal
import subprocess
import tempfile
import threading

DRAIN_LIMIT = 1 << 20  # bytes after the end of the archive we still read to see the exit status


def is_remote(url: str) -> bool:
    """Whether a failure to read `url` may be transient (worth retrying)."""
    return url.startswith("pipe:") or ("://" in url and not url.startswith("file://"))


def open_url(url: str, stall_timeout_s: float, open_timeout_s: float = 60.0):
    if url.startswith("pipe:"):
        return PipeStream(url[5:], stall_timeout_s)
    if url.startswith(("http://", "https://")):
        return PipeStream(f"curl -sSL --fail {shlex.quote(url)}", stall_timeout_s)
    if "://" in url and not url.startswith("file://"):  # s3, gs...: webdataset's handlers
        from webdataset.gopen import gopen

        return gopen(url, "rb")
    return open_within(url.removeprefix("file://"), open_timeout_s)


def open_within(path: str, timeout_s: float):
    """open(path, "rb") that gives up after timeout_s (a hung network mount, a FIFO nobody
    writes): the open goes on in a daemon thread, which closes the file if it ever arrives."""
    box: dict = {}
    lock, done = threading.Lock(), threading.Event()

    def run() -> None:
        try:
            f = open(path, "rb")  # noqa: SIM115 (handed to the caller, or closed below)
        except OSError as e:
            box["error"] = e
            f = None
        with lock:
            if box.get("abandoned") and f is not None:
                f.close()
            box["file"] = f
        done.set()

    threading.Thread(target=run, daemon=True, name=f"open {path}").start()
    if not done.wait(timeout_s):
        with lock:
            if "file" not in box:
                box["abandoned"] = True
                raise OSError(f"not opened within open_timeout_s {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["file"]


class PipeStream:
    """The stdout of a shell command, read with a stall timeout; stderr kept for the message."""

    def __init__(self, cmd: str, stall_timeout_s: float):
        self.cmd, self.timeout = cmd, stall_timeout_s
        self._err = tempfile.TemporaryFile()  # noqa: SIM115 (closed in finish)
        # its own process group: stopping it also stops the command's children (curl, aws...)
        self.proc = subprocess.Popen(cmd, shell=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=self._err, start_new_session=True)
        self._fd = self.proc.stdout.fileno()
        self.stalled, self.result = False, None
        self._done = False

    def read(self, n: int = -1) -> bytes:
        n = 1 << 16 if n is None or n < 0 else n
        ready, _, _ = select.select([self._fd], [], [], self.timeout)
        if not ready:
            self.stalled = True
            raise OSError(f"stalled: no data for {self.timeout:g} s")
        return os.read(self._fd, n)

    def finish(self, read_all: bool) -> str | None:
        """Close the stream; -> why the command failed, or None. `read_all`: the reader wanted the
        whole archive, so drain the tail and judge the exit status (else stop the command: a
        command cut off early exits non-zero, and nothing was lost)."""
        if self._done:
            return self.result
        self._done, drained = True, 0
        with contextlib.suppress(OSError):
            while read_all and not self.stalled and drained <= DRAIN_LIMIT and (chunk := self.read(1 << 16)):
                drained += len(chunk)
        clean = read_all and not self.stalled and drained <= DRAIN_LIMIT
        if not clean or self.proc.poll() is None and not _wait(self.proc, 5.0):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        code = self.proc.wait()
        self.proc.stdout.close()
        self._err.seek(0)
        tail = self._err.read()[-300:].decode("utf-8", "replace").strip().replace("\n", " | ")
        self._err.close()
        if self.stalled:
            self.result = f"stalled: no data for {self.timeout:g} s"
        elif clean and code != 0:
            self.result = f"exit status {code}" + (f": {tail}" if tail else "")
        return self.result

    def close(self) -> None:
        self.finish(read_all=False)


def _wait(proc: subprocess.Popen, timeout: float) -> bool:
    try:
        proc.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        return False
