"""The rooms keep their arrows: the control plane runs without torch, the pure parts without Ray.

Each check imports in a fresh interpreter in which the forbidden package cannot be imported at
all (a ``sys.meta_path`` finder refuses it), so a lazy import that is really eager fails here.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

BLOCK = textwrap.dedent(
    """
    import importlib.abc, sys

    class Block(importlib.abc.MetaPathFinder):
        def __init__(self, names):
            self.names = names

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in self.names:
                raise ImportError(f"{name} is blocked in this test")
            return None

    sys.meta_path.insert(0, Block(BLOCKED))
    """
)


def run_blocked(blocked: set[str], code: str) -> subprocess.CompletedProcess[str]:
    program = BLOCK.replace("BLOCKED", repr(sorted(blocked))) + textwrap.dedent(code)
    return subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120
    )


CONTROL_PLANE = [
    "spikeguard.supervisor.cli",
    "spikeguard.supervisor.controller",
    "spikeguard.supervisor.intake.collector",
    "spikeguard.supervisor.journal",
    "spikeguard.supervisor.decide.recovery",
    "spikeguard.supervisor.runner",
    "spikeguard.supervisor.launch.group",
    "spikeguard.supervisor.launch.agent",
    "spikeguard.supervisor.launch.reaper",
    "spikeguard.supervisor.observe.exporter",
    "spikeguard.supervisor.observe.report",
    "spikeguard.policies",
    "spikeguard.policies.commands",
    "spikeguard.workers",
    "spikeguard.workers.contract",
    "spikeguard.workers.checkpoint",
    "spikeguard.workers.checkpoint.choose",
    "spikeguard.workers.checkpoint.commit",
    "spikeguard.workers.checkpoint.retention",
    "spikeguard.workers.checkpoint.remove",
    "spikeguard.supervisor.observe.checkpoint_table",
]


@pytest.mark.parametrize("module", CONTROL_PLANE)
def test_the_control_plane_imports_without_torch(module):
    res = run_blocked({"torch"}, f"import {module}")
    assert res.returncode == 0, res.stderr[-3000:]


def test_the_cli_runs_without_torch():
    code = """
    import sys
    from spikeguard.supervisor.cli import main
    sys.argv = ["spikeguard", "policy", "check", "default"]
    code = main(["policy", "check", "default"])
    assert code == 0, code
    assert "torch" not in sys.modules
    """
    res = run_blocked({"torch"}, code)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "ok" in res.stdout


PURE = [
    "spikeguard.supervisor.decide.recovery",
    "spikeguard.supervisor.intake.collector",
    "spikeguard.supervisor.intake.validate",
    "spikeguard.supervisor.decide.events",
    "spikeguard.supervisor.journal",
    "spikeguard.supervisor.controller",
    "spikeguard.supervisor.redaction",
    "spikeguard.supervisor.launch.environment",
    "spikeguard.supervisor.intake.forensics",
    "spikeguard.supervisor.observe.status",
    "spikeguard.supervisor.observe.metrics",
    "spikeguard.supervisor.observe.svg",
    "spikeguard.policies",
    "spikeguard.workers.contract",
    "spikeguard.workers.checkpoint.choose",
    "spikeguard.workers.checkpoint.commit",
    "spikeguard.workers.checkpoint.retention",
    "spikeguard.workers.checkpoint.remove",
    "spikeguard.supervisor.observe.checkpoint_table",
]


@pytest.mark.parametrize("module", PURE)
def test_the_pure_parts_import_neither_ray_nor_torch(module):
    res = run_blocked({"torch", "ray"}, f"import {module}")
    assert res.returncode == 0, res.stderr[-3000:]


def test_the_workers_never_import_ray_or_the_supervisor():
    code = """
    import sys
    import spikeguard.workers as sgw
    sgw.attach  # loads the torch side: session, probes, channel, signals
    import spikeguard.workers.checkpoint as ckpt
    ckpt.write_checkpoint, ckpt.load_checkpoint, ckpt.ShardedWriter, ckpt.load_sharded
    bad = [m for m in sys.modules if m.startswith(("spikeguard.supervisor", "spikeguard.policies"))]
    assert not bad, bad
    """
    res = run_blocked({"ray"}, code)
    assert res.returncode == 0, res.stderr[-3000:]


def test_a_blocked_import_really_fails():
    # the harness itself: importing torch where it is blocked must fail, or the tests above
    # would pass vacuously
    res = run_blocked({"torch"}, "import spikeguard.workers.measure")
    assert res.returncode != 0 and "blocked in this test" in res.stderr
