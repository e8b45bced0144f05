"""The embedded Ray's dashboard port: 8265 when free, another free port when something holds it
(a second job on the machine, a user's own Ray), so a taken port never stops a job."""

from __future__ import annotations

import socket

from spikeguard.supervisor.launch.ray_init import dashboard_port


def _listening() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("0.0.0.0", 0))
    s.listen()
    return s


def test_a_free_preferred_port_is_kept():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    assert dashboard_port(port) == port


def test_a_taken_port_is_replaced_by_a_free_one():
    with _listening() as held:
        port = held.getsockname()[1]
        other = dashboard_port(port)
        assert other != port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", other))  # free for Ray to take
