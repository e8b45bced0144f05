"""A real S3-compatible server for the tests: moto in server mode (``moto[server]``, the ``test``
extra), reached over HTTP on 127.0.0.1 by the real s3fs/botocore clients, nothing mocked.

* the ``s3_server`` fixture (one per test session): :class:`S3Server`, moto's
  ``ThreadedMotoServer`` on a free loopback port;
* the ``s3`` fixture (one per test): a fresh :class:`Bucket` on it, and the standard environment
  pointing at it (``AWS_ENDPOINT_URL``, the keys, the region) through ``monkeypatch``, with
  anything of the developer's own AWS set-up (profile, config files, retry settings) kept out;
* the ``s3_throttle`` fixture: a :class:`Throttle` between the clients and the server, which
  answers the requests it is told to with S3's ``503 SlowDown``, the environment pointing at it.

Tests that use them skip, saying why, where moto or s3fs is not installed.
"""

from __future__ import annotations

import dataclasses
import http.client
import http.server
import importlib.util
import itertools
import logging
import os
import socket
import threading
import urllib.parse
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

MISSING = (
    "moto[server] and s3fs are not installed: `pip install -e '.[test]'` (make setup) installs "
    "them, to run the object-storage tests against a local S3 server"
)
ACCESS_KEY = "AKIASPIKEGUARDTEST01"
"""The access key id the tests use (moto takes any)."""
SECRET_KEY = "spikeguard-test-secret-Zq9vW3xR7kL2"
"""The secret key the tests use: distinctive, so a test can tell it never leaks into a message."""
REGION = "us-east-1"
_KEPT_OUT = (
    "AWS_ENDPOINT_URL_S3",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_MAX_ATTEMPTS",
    "AWS_RETRY_MODE",
    "AWS_REGION",
)
_NAMES = itertools.count(1)


def missing() -> str | None:
    """Why the server cannot run here (:data:`MISSING`: moto's server or s3fs is absent), or
    None when it can."""
    if importlib.util.find_spec("moto") is None or importlib.util.find_spec("s3fs") is None:
        return MISSING
    try:
        import moto.server  # noqa: F401  # its extra (flask, werkzeug) is what is missing
    except ImportError:
        return MISSING
    return None


def need_s3() -> None:
    """Skip the calling test, with the reason, where moto's server or s3fs is absent."""
    reason = missing()
    if reason is not None:
        pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """moto's S3 in server mode on 127.0.0.1; :meth:`stop` when done."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        self.port = _free_port()
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    @property
    def endpoint(self) -> str:
        """Its URL (``http://127.0.0.1:PORT``)."""
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> Any:
        """A boto3 S3 client of its own (the test's hand on the bucket, beside the code's)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )

    def stop(self) -> None:
        """Stop serving."""
        self._server.stop()


@dataclasses.dataclass
class Bucket:
    """A fresh bucket of the server, for one test."""

    name: str
    server: S3Server
    client: Any
    """boto3's client, to look at or damage objects behind the code's back."""

    def url(self, key: str = "") -> str:
        """``s3://NAME/KEY``."""
        return f"s3://{self.name}/{key}" if key else f"s3://{self.name}"

    def objects(self, prefix: str = "") -> list[str]:
        """Every object's key under ``prefix``, sorted."""
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.name, Prefix=prefix
        )
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def get(self, key: str) -> bytes:
        """The bytes of the object ``key``."""
        return self.client.get_object(Bucket=self.name, Key=key)["Body"].read()

    def put(self, key: str, data: bytes) -> None:
        """Write (or replace) the object ``key``."""
        self.client.put_object(Bucket=self.name, Key=key, Body=data)


def store_environment(environ: Mapping[str, str], endpoint: str) -> dict[str, str]:
    """``environ`` with the standard AWS environment (and nothing else of it) saying where the
    store is: the developer's own AWS set-up left out, the test keys and region in."""
    env = {k: v for k, v in environ.items() if k not in _KEPT_OUT}
    env.update(
        AWS_CONFIG_FILE="/nonexistent/spikeguard-test/config",
        AWS_SHARED_CREDENTIALS_FILE="/nonexistent/spikeguard-test/credentials",
        AWS_EC2_METADATA_DISABLED="true",
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID=ACCESS_KEY,
        AWS_SECRET_ACCESS_KEY=SECRET_KEY,
        AWS_DEFAULT_REGION=REGION,
    )
    return env


def point_environment(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    """Make the standard AWS environment (and nothing else) say where the store is
    (:func:`store_environment`), in this process."""
    wanted = store_environment(os.environ, endpoint)
    for name in set(os.environ) - set(wanted):
        monkeypatch.delenv(name)
    for name, value in wanted.items():
        if os.environ.get(name) != value:
            monkeypatch.setenv(name, value)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One server for the whole session (each test has its own bucket)."""
    need_s3()
    server = S3Server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    """A fresh bucket, and the environment pointing at the server."""
    name = f"spikeguard-test-{next(_NAMES)}-{_free_port()}"
    client = s3_server.client()
    client.create_bucket(Bucket=name)
    point_environment(monkeypatch, s3_server.endpoint)
    return Bucket(name=name, server=s3_server, client=client)


_SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message>"
    b"<RequestId>spikeguard-throttle</RequestId></Error>"
)
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length"}


class Throttle:
    """An HTTP relay on 127.0.0.1 in front of ``upstream`` (the S3 server) that answers the next
    :attr:`failing` requests ``503 SlowDown``, as a throttled S3 does, and relays the others.
    Counts what it sees; :meth:`stop` when done."""

    def __init__(self, upstream: str) -> None:
        target = urllib.parse.urlsplit(upstream)
        self._host, self._port = target.hostname or "127.0.0.1", target.port or 80
        self._lock = threading.Lock()
        self.failing = 0
        """How many of the next requests are answered 503 (set it, or :meth:`fail_next`)."""
        self.requests = 0
        """Requests seen."""
        self.throttled = 0
        """Requests answered 503."""
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """Its URL, for ``AWS_ENDPOINT_URL``."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def fail_next(self, n: int) -> None:
        """Answer the next ``n`` requests 503 SlowDown."""
        with self._lock:
            self.failing = n

    def _throttle_this(self) -> bool:
        with self._lock:
            self.requests += 1
            if self.failing > 0:
                self.failing -= 1
                self.throttled += 1
                return True
            return False

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        throttle = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        chunk = self.rfile.read(size)
                        self.rfile.readline()
                        if size == 0:
                            break
                        chunks.append(chunk)
                    return b"".join(chunks)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _relay(self) -> None:
                body = self._body()
                if throttle._throttle_this():
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(_SLOW_DOWN)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(_SLOW_DOWN)
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                headers["Content-Length"] = str(len(body))
                upstream = http.client.HTTPConnection(throttle._host, throttle._port, timeout=60)
                try:
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    answer = upstream.getresponse()
                    data = answer.read()
                    self.send_response(answer.status)
                    for k, v in answer.getheaders():
                        if k.lower() not in _HOP_BY_HOP:
                            self.send_header(k, v)
                    length = answer.getheader("Content-Length", "0")  # HEAD: the object's
                    self.send_header(
                        "Content-Length", length if self.command == "HEAD" else str(len(data))
                    )
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    upstream.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

        return Handler

    def stop(self) -> None:
        """Stop relaying."""
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def s3_throttle(s3: Bucket, monkeypatch: pytest.MonkeyPatch) -> Iterator[Throttle]:
    """A :class:`Throttle` in front of the server, the environment pointing at it (``s3``'s
    bucket is reached through it)."""
    throttle = Throttle(s3.server.endpoint)
    point_environment(monkeypatch, throttle.endpoint)
    try:
        yield throttle
    finally:
        throttle.stop()
