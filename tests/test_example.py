"""The diverging example runs end to end as a 2-process gloo job and reports through the SDK.

Two real subprocesses with the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT) run a few dozen steps and append rank-side reports
to one JSONL file; then one process resumes from the checkpoint the job wrote,
under a supervisor-style plan (LR x0.5, optimizer reset, a skipped step).
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
from conftest import run_ranks

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "gpt_diverge.py"
STEPS = 40


def _run(
    argv: list[str], world: int, timeout: float = 120, **extra: str
) -> list[subprocess.CompletedProcess]:
    return run_ranks(SCRIPT, argv, world, timeout, **extra)


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("example")
    report, ckpt = tmp / "reports.jsonl", tmp / "ckpt"
    argv = [
        "--steps",
        str(STEPS),
        "--seed",
        "3",
        "--sample-every",
        "10",
        "--ckpt-every",
        "20",
        "--ckpt-dir",
        str(ckpt),
        "--report",
        f"jsonl://{report}",
        "--log-every",
        "10",
        "--warmup",
        "30",
    ]
    res = _run(argv, world=2)
    for r, cp in enumerate(res):
        assert cp.returncode == 0, f"rank {r} failed:\n{cp.stdout}"
    return {
        "tmp": tmp,
        "report": report,
        "ckpt": ckpt,
        "out": res,
        "msgs": _read(report),
        "argv": argv,
    }


def test_two_rank_job_reports_heartbeats_and_layer_signals(job):
    msgs = job["msgs"]
    assert "finished: last step 39" in job["out"][0].stdout
    for rank in (0, 1):
        mine = [m for m in msgs if m["rank"] == rank]
        types = [m["type"] for m in mine]
        assert types[0] == "hello" and mine[0]["world_size"] == 2
        assert types[-1] == "done"
        steps = sorted(m["step"] for m in mine if m["type"] in ("heartbeat", "report"))
        assert steps == list(range(STEPS)), f"rank {rank} stepped {steps}"
        for m in mine:
            assert m["v"] == 1 and m["gen"] == 0
            if m["type"] in ("heartbeat", "report"):
                assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and m["lr"] > 0
        reports = [m for m in mine if m["type"] == "report"]
        assert [m["step"] for m in reports] == [0, 10, 20, 30]
        for m in reports:
            layers = m["layers"]
            for i in range(3):
                assert {"erank_ratio", "grade"} <= set(layers[f"blocks.{i}"])
                attn = layers[f"blocks.{i}.attn"]
                assert {
                    "attn_entropy_mean",
                    "attn_entropy_min",
                    "attn_entropy_min_norm",
                    "max_logit",
                } <= set(attn)
                assert 0.0 < attn["attn_entropy_min_norm"] <= 1.0 + 1e-6
            assert {"logz_mean", "logz_max"} <= set(layers["lm_head"])
            assert {"grade", "max_logit", "worst_layer"} <= set(m["summary"])
    # the gradients are all-reduced: both ranks report the same grad norm every step
    gn = {
        (m["rank"], m["step"]): m["grad_norm"] for m in msgs if m["type"] in ("heartbeat", "report")
    }
    assert all(math.isclose(gn[(0, s)], gn[(1, s)], rel_tol=1e-5) for s in range(STEPS))
    # rank 0 alone checkpoints, at 20 (step 0 is skipped by design)
    ck = [m for m in msgs if m["type"] == "checkpoint"]
    assert [(m["rank"], m["step"]) for m in ck] == [(0, 20)]
    assert Path(ck[0]["path"]).is_file() and ck[0]["grade"] is not None


def test_resume_under_a_plan_starts_after_the_checkpoint(job):
    from spikeguard.workers.contract import ResumePlan

    ck = next(m for m in job["msgs"] if m["type"] == "checkpoint")
    plan = ResumePlan(
        checkpoint=ck["path"],
        sha256=ck["sha256"],
        lr_scale=0.5,
        reset_optimizer=True,
        skip_ranges=((22, 23),),
        generation=1,
    )
    plan_path = job["tmp"] / "plan.json"
    plan_path.write_text(plan.to_json())
    report = job["tmp"] / "resumed.jsonl"
    argv = [a for a in job["argv"]]
    argv[argv.index("--report") + 1] = f"jsonl://{report}"
    [cp] = _run(argv, world=1, SPIKEGUARD_RESUME=str(plan_path), SPIKEGUARD_GENERATION="1")
    assert cp.returncode == 0, cp.stdout
    msgs = _read(report)
    resumed = next(m for m in msgs if m["type"] == "resumed")
    assert (
        resumed["lr_scale"] == 0.5
        and resumed["optimizer_reset"] is True
        and resumed["from_step"] == 21
    )
    assert [m["step"] for m in msgs if m["type"] == "skipped"] == [22, 23]
    beats = {m["step"]: m for m in msgs if m["type"] in ("heartbeat", "report")}
    assert sorted(beats) == [21] + list(range(24, STEPS))
    # the SDK's scale is on top of the script's schedule (heartbeats carry the effective LR)
    from spikeguard.examples.gpt_diverge import lr_at, parse_args

    args = parse_args(job["argv"])
    assert math.isclose(beats[30]["lr"], 0.5 * lr_at(30, args), rel_tol=1e-9)
    assert all(m["gen"] == 1 for m in msgs)


def test_batches_are_a_function_of_seed_step_rank():
    import torch
    from spikeguard.examples.data import Batches

    corpus = torch.arange(10_000, dtype=torch.int64).remainder(256).to(torch.uint8)
    two = Batches(corpus, seq_len=8, batch=4, world_size=2, seed=1)
    one = Batches(corpus, seq_len=8, batch=8, world_size=1, seed=1)
    x0, y0, ids0 = two.get(7, 0)
    _, _, ids1 = two.get(7, 1)
    assert ids0 + ids1 == one.ids(7, 0)  # ranks split the same global batch
    assert torch.equal(x0, Batches(corpus, 8, 4, 2, seed=1).get(7, 0)[0])  # no hidden state
    assert torch.equal(y0[:, :-1], x0[:, 1:])
    assert two.ids(7, 0) != two.ids(8, 0) and Batches(corpus, 8, 4, 2, seed=2).ids(7, 0) != ids0
