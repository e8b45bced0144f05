"""Debian's real Prometheus Alertmanager for the tests, routing every alert to a webhook receiver
the test owns (:class:`fakepagers.Receiver`), with waits short enough for a test.

``Alertmanager(tmp_path)`` runs ``/usr/bin/prometheus-alertmanager`` (package
``prometheus-alertmanager``; tests that need it skip, saying so, where it is absent) on a free
loopback port, gossip off (``--cluster.listen-address=``), its own storage in ``tmp_path``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from fakepagers import Receiver

BINARY = os.environ.get("SPIKEGUARD_TEST_ALERTMANAGER", "/usr/bin/prometheus-alertmanager")
MISSING = (
    f"Alertmanager not installed ({BINARY}): install Debian's prometheus-alertmanager "
    "(.ci/run does) to run the tests against a real one"
)


def available() -> bool:
    return bool(shutil.which(BINARY)) or os.access(BINARY, os.X_OK)


def need_alertmanager() -> None:
    """Skip the calling test, with the reason, where the binary is absent."""
    if not available():
        pytest.skip(MISSING)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CONFIG = """\
route:
  receiver: test
  group_by: ['alertname', 'run', 'incident', 'rule', 'rank']
  group_wait: 1s
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: test
    webhook_configs:
      - url: '{url}/alertmanager'
        send_resolved: true
"""


class Alertmanager:
    """A running Alertmanager whose one receiver is :attr:`receiver`."""

    def __init__(self, tmp_path: Path) -> None:
        need_alertmanager()
        self.receiver = Receiver()
        home = tmp_path / "alertmanager"
        home.mkdir(parents=True, exist_ok=True)
        config = home / "alertmanager.yml"
        config.write_text(CONFIG.format(url=self.receiver.url))
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (home / "alertmanager.log").open("wb")
        self.proc = subprocess.Popen(
            [
                BINARY,
                f"--config.file={config}",
                f"--storage.path={home / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--cluster.listen-address=",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 120
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(
                    f"Alertmanager did not come up: {(home / 'alertmanager.log').read_text()}"
                )
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def alerts(self) -> list[dict[str, Any]]:
        """What Alertmanager holds now (``GET /api/v2/alerts``)."""
        with urllib.request.urlopen(self.url + "/api/v2/alerts", timeout=10) as r:
            return json.loads(r.read())

    def notifications(self) -> list[dict[str, Any]]:
        """The webhook notifications Alertmanager sent to the receiver, in order."""
        return [r.json for r in self.receiver.requests if r.path == "/alertmanager"]

    def wait_for_status(self, status: str, timeout_s: float = 120.0, **labels: str) -> bool:
        """Wait until a notification of ``status`` (firing, resolved) carries an alert with
        ``labels``."""

        def seen(requests: list[Any]) -> bool:
            for r in requests:
                if r.path != "/alertmanager":
                    continue
                for a in r.json.get("alerts", []):
                    have = a.get("labels", {})
                    if a.get("status") == status and all(
                        have.get(k) == v for k, v in labels.items()
                    ):
                        return True
            return False

        return self.receiver.wait_for(seen, timeout_s)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        self.receiver.close()

    def __enter__(self) -> Alertmanager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
