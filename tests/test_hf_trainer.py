"""The Hugging Face Trainer callback end to end: examples/hf_llama_diverge.py (a tiny Llama trained
by ``transformers.Trainer``) on 2 real gloo ranks under the real supervisor on an embedded Ray.

One run covers: reports every step with the registry-captured attention entropies, graded
``checkpoint-N`` directories, an injected collapse (the example's test hook ``SG_HF_COLLAPSE``)
that leads to kill -> rollback into the Trainer's own checkpoint -> resumed training at the cut
LR with a fresh optimizer, as the resumed ranks themselves observed it (``SG_HF_OBSERVE``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TEST_TIMEOUTS, events, reports
from spikeguard.policies.schema import RecoverySettings

pytest.importorskip("transformers")

from spikeguard.workers import checkpoint as ckpt

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
COLLAPSE_AT = 26
TOY_POLICY = Path(__file__).parent / "data" / "toy_policy.yaml"


def _policy(path: Path) -> Path:
    """The toy policy with a short probation and ``min_grade`` S0: any graded checkpoint (this
    2-layer toy's residual grade is low from step 10 on)."""
    import yaml

    doc = yaml.safe_load(TOY_POLICY.read_text())
    doc["recovery"].update(min_grade="S0", probation_steps=10)
    path.write_text(yaml.safe_dump(doc))
    return path


def test_trainer_callback_reports_grades_and_rolls_back_into_the_trainers_checkpoint(
    ray_local, tmp_path
) -> None:
    from spikeguard.supervisor.job import JobSpec
    from spikeguard.supervisor.runner import run_job

    policy = _policy(tmp_path / "policy.yaml")
    observed = tmp_path / "observed"
    job = JobSpec(
        name="hf",
        entrypoint=str(ROOT / "examples" / "hf_llama_diverge.py"),
        args=[
            *("--steps", "40", "--save-steps", "10", "--sample-every", "5"),
            *("--lr", "0.003", "--warmup", "10", "--layers", "2", "--batch", "8", "--seq", "32"),
            *("--data-bytes", "200000"),
        ],
        workers=2,
        policy=str(policy),
        run_dir=str(tmp_path / "run"),
        env={"SG_HF_COLLAPSE": f"{COLLAPSE_AT}:1", "SG_HF_OBSERVE": str(observed)},
        timeouts={"heartbeat_s": 60, "first_heartbeat_s": 120, **TEST_TIMEOUTS},
        metrics={"port": 0},
    )
    assert run_job(job, live=False) == 0
    run = Path(job.run_dir)
    evs = events(run)
    kinds = [e["kind"] for e in evs]
    story = ["incident", "kill", "rollback", "lr_cut", "optimizer_reset", "probation_start"]
    it = iter(kinds)
    assert all(k in it for k in [*story, "completed"]), kinds

    # reports flow every step, with the attention entropies the registry captured
    msgs = reports(run)
    gen1 = [m for m in msgs if m["gen"] == 1 and m["type"] in ("heartbeat", "report")]
    for rank in (0, 1):
        steps = sorted(m["step"] for m in gen1 if m["rank"] == rank)
        # (a killed rank's last queued messages may die with it: the steps well before)
        assert set(range(1, 21)) <= set(steps), (rank, steps)
        assert all(m["loss"] is not None and m["lr"] is not None for m in gen1 if m["step"] < 20)
    sampled = [m for m in gen1 if m["type"] == "report"]
    assert {m["step"] for m in sampled} >= {5, 10, 15, 20}
    attn = sampled[0]["layers"]["model.layers.0.self_attn"]
    assert attn["attn_entropy_mean"] > 0 and 0 < attn["attn_entropy_min_norm"] <= 1.0001
    assert sampled[0]["summary"]["grade"] is not None

    # the Trainer's checkpoints carry a grade and verify
    committed = [m for m in msgs if m["type"] == "checkpoint"]
    assert committed and all(m["kind"] == "hf-trainer" and m["rank"] == 0 for m in committed)
    assert all(Path(m["path"]).name == f"checkpoint-{m['step']}" for m in committed)
    listed = ckpt.list_checkpoints(run / "checkpoints")
    trainer_ckpts = [i for i in listed if i.kind == "hf-trainer"]
    assert {i.step for i in trainer_ckpts} >= {30, 40}
    # the job's retention (the defaults) manages them too: each one committed is listed or deleted
    deleted = {e["path"]: e for e in evs if e["kind"] == "checkpoint_deleted"}
    assert {m["path"] for m in committed} <= {i.path for i in trainer_ckpts} | set(deleted)
    assert all(e["checkpoint_kind"] == "hf-trainer" for e in deleted.values())
    for info in trainer_ckpts:
        assert info.grade is not None and info.world_size == 2
        ckpt.verify(info)
        assert {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= {
            name for name, _, _ in info.files
        }

    # the rollback went into the Trainer's own checkpoint before the collapse
    rollback = next(e for e in evs if e["kind"] == "rollback")
    target = Path(rollback["checkpoint_path"])
    assert target.name == f"checkpoint-{rollback['checkpoint_step']}"
    assert rollback["checkpoint_step"] < COLLAPSE_AT and rollback["grade"] is not None
    relaunch = next(e for e in evs if e["kind"] == "launch" and e["plan"]["checkpoint"])
    assert relaunch["plan"]["checkpoint"] == str(target) and relaunch["plan"]["lr_scale"] == 0.5
    gen = relaunch["generation"]

    # what the resumed ranks saw: the Trainer's step from checkpoint-N, an empty optimizer
    # state at the first step (the reset won over optimizer.pt), the LR at half the schedule's
    for rank in (0, 1):
        seen = json.loads((observed / f"gen{gen}-rank{rank}.json").read_text())
        assert seen["global_step"] == rollback["checkpoint_step"], seen
        assert seen["optimizer_state_at_first_step"] == 0, seen
        # the first step after the optimizer reset re-warms: 1/rewarm_steps of the cut LR
        rewarm = RecoverySettings().rewarm_steps
        assert seen["lr_used"] == pytest.approx(0.5 * seen["lr_schedule"] / rewarm, rel=1e-9), seen
        first = json.loads((observed / f"gen1-rank{rank}.json").read_text())
        assert first["global_step"] == 0 and first["lr_used"] == pytest.approx(
            first["lr_schedule"], rel=1e-9
        )
    resumed = [m for m in msgs if m["type"] == "resumed" and m["gen"] == gen]
    assert sorted(m["rank"] for m in resumed) == [0, 1]
    for m in resumed:
        assert m["checkpoint"] == str(target) and m["optimizer_reset"] is True
        assert m["from_step"] == rollback["checkpoint_step"] + 1 and m["lr_scale"] == 0.5
    after = [m for m in msgs if m["gen"] == gen and m["type"] in ("heartbeat", "report")]
    assert max(m["step"] for m in after) == 40
    assert all(m["lr"] is not None for m in after)
