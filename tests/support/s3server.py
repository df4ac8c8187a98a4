"""A real S3-compatible server for the tests: moto's standalone server on 127.0.0.1.

:func:`start` runs it as a separate process on a free loopback port and waits (with a
hard timeout) until it answers; :func:`stop` ends it. Tests reach it through the standard
``AWS_ENDPOINT_URL`` and credential variables, which torchrun workers inherit.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import select
import socket
import subprocess
import sys
import threading

BUCKET = "ddpckpt-test"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def missing() -> str | None:
    """Why the S3 tests cannot run here, or ``None``."""
    for module, extra in (("boto3", "boto3"), ("moto.server", "moto[server]")):
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:
            found = False
        if not found:
            return f"S3 tests need {extra} (pip install -e '.[test]')"
    return None


# The server binds a port the system picks and says which: no port is picked here and then
# bound by someone else first.
_SERVE = """
import threading
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer("127.0.0.1", 0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
threading.Event().wait()
"""


def start(timeout: float = 60.0) -> tuple[subprocess.Popen[bytes], str]:
    """A running server and its endpoint URL; raises if it does not answer in time."""
    process = subprocess.Popen(
        [sys.executable, "-c", _SERVE],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    line = process.stdout.readline() if ready else b""
    if not line.strip().isdigit():
        stop(process)
        raise RuntimeError(
            f"moto server did not say its port in {timeout} s (exit status {process.returncode})"
        )
    return process, f"http://127.0.0.1:{int(line)}"


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def make_bucket(endpoint: str, bucket: str = BUCKET) -> None:
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
    )
    client.create_bucket(Bucket=bucket)


def environment(endpoint: str) -> dict[str, str]:
    """The variables that point boto3 (in this and child processes) at ``endpoint``."""
    return {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}


def set_environment(endpoint: str) -> dict[str, str | None]:
    """Set :func:`environment` in ``os.environ``; the previous values, for restoring."""
    previous = {}
    for name, value in environment(endpoint).items():
        previous[name] = os.environ.get(name)
        os.environ[name] = value
    return previous


def restore_environment(previous: dict[str, str | None]) -> None:
    for name, value in previous.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


class Outage:
    """A TCP forwarder on loopback in front of the server that goes down, as a server that
    stops answering does, at the first request whose bytes hold ``trip``: every open
    connection is cut and new ones are closed at once, until :meth:`up`. The server keeps
    its objects, so a test can look at what was committed afterwards."""

    def __init__(self, endpoint: str, trip: bytes) -> None:
        self._target = ("127.0.0.1", int(endpoint.rsplit(":", 1)[1]))
        self._trip, self.tripped = trip, threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def up(self) -> None:
        self.tripped.clear()

    def arm(self, trip: bytes) -> None:
        """Go down at the next request holding ``trip`` instead."""
        self._trip = trip

    def close(self) -> None:
        self._listener.close()
        self._cut()

    def _cut(self) -> None:
        with self._lock:
            sockets, self._open = self._open, []
        for sock in sockets:
            with contextlib.suppress(OSError):  # the peer may have gone already
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            if self.tripped.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(self._target, timeout=10)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, request: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                if request and self._trip in data and not self.tripped.is_set():
                    self.tripped.set()
                    self._cut()
                    return
                if self.tripped.is_set():
                    return
                sink.sendall(data)
        except OSError:
            return
