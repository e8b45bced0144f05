"""The parts a rank's Session is made of (spikeguard.workers.rank): the configuration read once
from the environment, the supervisor's requests from arrival to answer, and the rule that no
part reaches into another's private members."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from spikeguard.workers import contract
from spikeguard.workers.rank.config import RankConfig
from spikeguard.workers.rank.reports import Reporter, Requests

WORKERS = Path(__file__).resolve().parent.parent / "workers"


def test_the_environment_overrides_attach_arguments(monkeypatch):
    for name, value in {
        "RANK": "3",
        "WORLD_SIZE": "8",
        contract.ENV_GENERATION: "5",
        contract.ENV_RUN_ID: "env-run",
        contract.ENV_SAMPLE_EVERY: "7",
        contract.ENV_CKPT_DIR: "/env/ck",
        contract.ENV_REPORT: "off",
        contract.ENV_FENCE_FILE: "/env/FENCE",
        contract.ENV_STANDBY: "4242",
    }.items():
        monkeypatch.setenv(name, value)
    config = RankConfig.from_env(run_id="arg", sample_every=100, ckpt_dir="/arg/ck")
    assert (config.rank, config.world_size, config.generation) == (3, 8, 5)
    assert (config.run_id, config.sample_every, config.ckpt_dir) == ("env-run", 7, "/env/ck")
    assert config.fence_file == "/env/FENCE" and config.report == "off"
    assert config.standby and config.standby_agent == 4242


def test_without_the_environment_the_arguments_decide(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", contract.ENV_STANDBY, contract.ENV_SAMPLE_EVERY):
        monkeypatch.delenv(name, raising=False)
    for name in (contract.ENV_RUN_ID, contract.ENV_CKPT_DIR, contract.ENV_GENERATION):
        monkeypatch.delenv(name, raising=False)
    config = RankConfig.from_env(run_id="arg", sample_every=9, batch_ids_window=3)
    assert (config.rank, config.world_size, config.generation) == (0, 1, 0)
    assert (config.run_id, config.sample_every, config.batch_ids_window) == ("arg", 9, 3)
    assert not config.standby and config.ckpt_dir is None
    with pytest.raises(ValueError, match="sample_every must be >= 1"):
        RankConfig.from_env(sample_every=0)
    with pytest.raises(TypeError):
        RankConfig(3)  # type: ignore[misc]  # keyword-only: a positional rank is refused


class Inbox:
    """A channel stand-in: the requests handed to the rank, and the messages it sent."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.sent: list[dict] = []
        self.dropped_unencodable = 0

    def send(self, msg: dict) -> bool:
        self.sent.append(msg)
        return True

    def poll_requests(self) -> list[dict]:
        out, self.requests = self.requests, []
        return out

    def close(self, timeout: float = 5.0) -> None:
        pass


def requests_on(inbox: Inbox) -> Requests:
    reporter = Reporter(inbox, run_id="r", generation=1, rank=0)  # type: ignore[arg-type]
    return Requests(reporter, batch_ids_window=2)


def test_a_checkpoint_request_is_claimed_once_and_answered_by_the_next_checkpoint():
    inbox = Inbox()
    requests = requests_on(inbox)
    inbox.requests = [{"type": "checkpoint", "id": 1}, {"type": "checkpoint", "id": True}]
    requests.take()
    assert requests.claim() and not requests.claim()
    inbox.requests = [{"type": "checkpoint", "id": 1}, {"type": "checkpoint", "id": 2}]
    requests.take()  # 1 was seen before; 2 is pending, unclaimed
    assert requests.answered() == [1, 2] and requests.answered() == []


def test_the_ranks_agree_on_the_newest_request_any_of_them_saw():
    inbox = Inbox()
    requests = requests_on(inbox)
    inbox.requests = [{"type": "checkpoint", "id": 2}]
    requests.take()
    assert requests.claim_agreed(lambda newest: max(newest, 3))  # another rank saw 3 already
    assert requests.answered() == [2, 3]
    assert not requests.claim_agreed(lambda newest: max(newest, 3))  # agreed already
    inbox.requests = [{"type": "checkpoint", "id": 3}, {"type": "checkpoint", "id": 5}]
    requests.take()  # 3 reaches this rank late: answered already; 5 waits for an agreement
    assert requests.claim_agreed(lambda newest: newest) and requests.answered() == [5]


def test_a_batch_ids_request_is_answered_with_the_ring():
    inbox = Inbox()
    requests = requests_on(inbox)
    for step in range(4):
        requests.record(step, [step])
    inbox.requests = [{"type": "batch_ids", "id": 1}]
    requests.answer_batch_ids(3)
    (answer,) = inbox.sent
    assert answer["type"] == "batch_ids" and answer["step"] == 3 and answer["request"] == 1
    assert answer["entries"] == [[2, [2]], [3, [3]]] and answer["window"] == 2
    inbox.requests = [{"type": "batch_ids", "id": 1}]
    requests.answer_batch_ids(4)
    assert len(inbox.sent) == 1  # a request seen before is not answered twice


def _private_reaches(path: Path) -> list[str]:
    """``x._name`` where ``x`` is not ``self`` or ``cls``: one object reaching into another."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__"):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        found.append(f"{path.relative_to(WORKERS)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_part_of_the_session_reaches_into_another_parts_private_members():
    files = [
        *sorted((WORKERS / "rank").glob("*.py")),
        WORKERS / "session.py",
        WORKERS / "integrations" / "hf.py",
        WORKERS / "integrations" / "lightning.py",
        WORKERS / "integrations" / "lightning_io.py",
    ]
    assert len(files) > 8
    assert [hit for path in files for hit in _private_reaches(path)] == []
