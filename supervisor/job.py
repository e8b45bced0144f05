"""The job spec (``spikeguard submit job.yaml``): what to run, where, under which policy.

Validated with pydantic (unknown fields are errors); YAML is read with the
same safe, line-aware loader as policies, so every error names the file,
line and field.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from spikeguard.policies.loader import load_model_file, load_policy
from spikeguard.workers.checkpoint import location
from spikeguard.workers.contract.secret_scan import find_secret

from .redaction import notify_variable

if TYPE_CHECKING:
    from spikeguard.policies import Policy


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


class Timeouts(_Strict):
    heartbeat_s: float = Field(60.0, gt=0)
    """A rank that sent no message for this long is hung (an incident)."""
    first_heartbeat_s: float = Field(300.0, gt=0)
    """Allowance for the first message after a launch (imports, data loading, compilation)."""
    kill_grace_s: float = Field(0.0, ge=0)
    """SIGTERM first and wait this long before SIGKILL (0: SIGKILL at once)."""
    restart_backoff_s: float = Field(2.0, ge=0)
    """Wait before relaunch attempt n of an incident (and launch retry n): this x 2^(n-1)
    seconds."""
    restart_backoff_max_s: float = Field(60.0, ge=0)
    """Cap of that exponential backoff."""
    launch_retries: int = Field(3, ge=0)
    """A rank exiting non-zero before its first heartbeat is a launch failure: relaunched (fresh
    port, new generation) up to this many times in a row, outside the policy's recovery budget;
    then the job fails."""
    agent_timeout_s: float = Field(30.0, gt=0)
    """A rank agent that does not answer polls for this long is lost (its node froze or was
    partitioned)."""
    preempt_grace_s: float = Field(30.0, ge=0)
    """After SIGTERM (a preemption), how long the ranks have to write an emergency checkpoint
    before they are killed and the supervisor exits 143. Keep it below the platform's deadline
    (Kubernetes terminationGracePeriodSeconds, Ray's RAY_JOB_STOP_WAIT_TIME_S)."""
    reap_interval_s: float = Field(30.0, gt=0)
    """How often rank processes of replaced generations (frozen nodes come back) are looked for and
    killed."""
    batch_ids_s: float = Field(10.0, ge=0)
    """At an incident, how long the kill waits for the ranks' recent batch ids (each rank answers
    at the end of its current step: keep it above your step time). Ranks that exited or fell
    silent are not waited for; 0: the ranks are not asked."""


class RaySettings(_Strict):
    """Where the job runs."""

    address: str | None = None
    """An existing Ray cluster (``auto`` or ``host:port``; the supervisor must run on a node of
    it, sharing the run directory); None starts an embedded local Ray."""
    dashboard: bool = True
    """The embedded Ray's dashboard (http://127.0.0.1:8265), when Ray's dashboard is installed
    (``pip install 'spikeguard[cluster]'``); ``false`` (or ``spikeguard submit --no-dashboard``)
    keeps it off. An existing cluster's dashboard is the cluster's business."""
    object_store_mb: int = Field(256, ge=80)
    """Object store size of the embedded Ray (Ray would otherwise reserve 30 % of RAM)."""
    num_cpus: int | None = Field(None, ge=1)
    """Logical CPUs of the embedded Ray (default: enough for the workers, at least the
    machine's)."""


class Placement(_Strict):
    """How Ray places the gang of ranks."""

    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """PACK: as few nodes as possible; SPREAD: across nodes where it can; STRICT_PACK: one node;
    STRICT_SPREAD: one rank per node."""
    timeout_s: float = Field(120.0, gt=0)
    """How long the gang may wait for its resources before the launch fails (a launch failure,
    retried with the job's launch_retries)."""


class Logs(_Strict):
    """Where the ranks' output goes (it is always in RUN_DIR/logs/genNNN-rankR.log in full)."""

    to_driver: bool = True
    """Also print each line on the supervisor's stdout, prefixed ``[gen N rank R]``: what
    ``ray job logs`` and a pod's log show."""
    max_bytes_per_s: float = Field(16384.0, gt=0)
    """Per rank, at most this much output per second on the supervisor's stdout; the rest is
    counted there and stays in the rank's log."""


class MetricsSettings(_Strict):
    enabled: bool = True
    """Serve Prometheus metrics at ``http://ADDRESS:PORT/metrics`` (needs the ``metrics`` extra:
    ``pip install 'spikeguard[metrics]'``; without it the run goes on without metrics)."""
    address: str = Field("127.0.0.1", min_length=1, max_length=255)
    """Where to listen: localhost by default; ``0.0.0.0`` for a Prometheus on another host."""
    port: int = Field(9477, ge=0, le=65535)
    """The port (0: any free one; the URL is written to ``RUN_DIR/metrics.url``). A port in use
    is said once and the run goes on without metrics."""
    max_layers: int = Field(64, ge=0, le=4096)
    """Per-layer series are exported, for each per-layer signal, for this many layer names: the
    worst layers by that signal (a layer replaces the least bad exported one when it is worse);
    the others' values are folded into one series ``layer="(other)"`` (their worst value), so a
    model's size never multiplies the series. 0: no per-layer series (the ``rank_`` families
    still carry each rank's worst layer)."""
    final_scrape_s: float = Field(30.0, ge=0)
    """When the run ends, keep serving until Prometheus has scraped the final state once (the
    alert rules tell a finished run from a dead supervisor by it), at most this long; not at all
    when nothing ever scraped this supervisor."""


class SlackJob(_Strict):
    channel: str | None = None
    """Slack channel id or name; default from SPIKEGUARD_SLACK_CHANNEL. The token comes from
    SLACK_BOT_TOKEN only."""
    mention: str | None = None
    """Who a page mentions, e.g. ``<!subteam^S0123>`` or ``<@U0123>``."""


class NotifyJob(_Strict):
    slack: SlackJob | None = None
    """Slack on-call settings (None: console only)."""


class CheckpointRetention(_Strict):
    """Where the run's checkpoints go, and which of them the supervisor keeps (replicated and
    sharded alike). It decides each time a rank reports a new checkpoint; each deletion is
    journaled (``checkpoint_deleted``). The checkpoint the current generation was launched
    from, or a pending relaunch will load, is never deleted, nor one a numerical rollback could
    choose. The defaults keep at most 3 + 2 × 2 checkpoints, plus those within the policy's
    ``min_steps_back`` of the newest, plus that one. Saves that never finished are removed once
    nothing can still write them."""

    keep_last: int = Field(3, ge=1)
    """The newest checkpoints on the run's lineage to keep, whatever their grade."""
    keep_every: int | None = Field(None, ge=1)
    """Also keep every checkpoint whose step is a multiple of this (an archive; None: none)."""
    keep_healthy: int = Field(2, ge=0)
    """The newest checkpoints graded at least ``min_grade`` to keep; when the policy rolls back
    ``min_steps_back`` steps, also every such checkpoint within that many steps of the newest
    one, and as many again before them."""
    min_grade: int | None = Field(None, ge=0, le=7)
    """What counts as healthy (None: the policy's ``recovery.min_grade``)."""
    enabled: bool = True
    """False: never delete a checkpoint (the disk use grows with the run)."""
    dir: str | None = Field(None, min_length=1)
    """Where the ranks write the checkpoints and the supervisor lists, verifies and deletes
    them: a plain path (relative to where ``spikeguard submit`` runs, like ``run_dir``) or an
    object store's URL, ``s3://bucket/runs/{name}`` (any fsspec URL of
    :data:`~spikeguard.workers.checkpoint.storage.OBJECT_STORE_SCHEMES`; S3 needs
    ``pip install 'spikeguard[s3]'``). ``{name}`` is substituted. The store's standard
    environment variables set where the supervisor runs (``AWS_*`` for S3: keys, endpoint,
    region) reach the ranks, and nothing else. None: ``RUN_DIR/checkpoints``."""

    @field_validator("dir")
    @classmethod
    def _servable(cls, v: str | None) -> str | None:
        why = None if v is None else location.problem(v)
        if why:
            raise ValueError(why)  # the loader's message names the field (checkpoints.dir)
        return v


class JobSpec(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
    """Run name: letters, digits, ``.``, ``_``, ``-``."""
    entrypoint: str = Field(min_length=1)
    """A torchrun-style training script (path, relative to the job file), or ``-m
    package.module``."""
    args: list[str] = []
    """Arguments passed to the entrypoint."""
    workers: int = Field(2, ge=1, le=4096)
    """Number of ranks (one Ray actor and one process each)."""
    cpus_per_worker: float = Field(1.0, ge=0)
    """CPUs reserved per rank."""
    gpus_per_worker: float = Field(0.0, ge=0)
    """GPUs reserved per rank (0 on CPU machines)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend hint, exported as SPIKEGUARD_BACKEND (auto: nccl with GPUs, else
    gloo)."""
    run_dir: str = "runs/{name}"
    """Where the journal, reports, checkpoints and logs go (``{name}`` is substituted)."""
    checkpoint_every: int | None = Field(None, ge=1)
    """Checkpoint interval in steps, exported as SPIKEGUARD_CKPT_EVERY: it overrides the script's
    own (``should_checkpoint(every=)``, the Lightning callback's ``checkpoint_every``, the HF
    Trainer's ``save_steps``), with a warning when they differ."""
    checkpoints: CheckpointRetention = CheckpointRetention()
    """Where the checkpoints go (``dir``), and how many to keep, and which."""
    sample_every: int | None = Field(None, ge=1)
    """Probe interval override, exported as SPIKEGUARD_SAMPLE_EVERY."""
    policy: str = "default"
    """A policy file (relative to the job file) or a built-in name: default, conservative,
    aggressive."""
    env: dict[str, str] = {}
    """Extra environment variables for the ranks (never secrets: those stay in your environment)."""
    pass_env: list[str] = []
    """Names of variables of the supervisor's environment the ranks need although they look like
    secrets (``WANDB_API_KEY``, ``HF_TOKEN``): passed as they are. Every other secret in the
    supervisor's environment is withheld from the ranks (except the checkpoint store's own
    variables: see ``checkpoints.dir``), and its own notification settings (``SLACK_BOT_TOKEN``,
    ``SPIKEGUARD_SLACK_*``) never pass."""
    timeouts: Timeouts = Timeouts()
    """Hang detection and kill settings."""
    ray: RaySettings = RaySettings()
    """Where to run."""
    placement: Placement = Placement()
    """How the gang of ranks is placed on the cluster's nodes."""
    standby: bool = False
    """Warm standby: while a generation trains, the next generation's rank processes are
    started and run the script up to ``resume()`` (imports, process group, model), so a
    recovery releases them instead of starting cold ones. Costs one more process per rank,
    with its memory (on a GPU its CUDA context and whatever the script puts there before
    ``resume()``). The script must call ``resume()`` (or ``step()``) before it trains."""
    logs: Logs = Logs()
    """Where the ranks' output goes."""
    notify: NotifyJob = NotifyJob()
    """On-call notification."""
    metrics: MetricsSettings = MetricsSettings()
    """The Prometheus endpoint."""

    @field_validator("env")
    @classmethod
    def _no_secrets(cls, v: dict[str, str]) -> dict[str, str]:
        found = find_secret(v)
        if found:
            raise ValueError(f"env.{found.path[0]}: {found.message('job file')}")
        return v

    @field_validator("pass_env")
    @classmethod
    def _passable(cls, v: list[str]) -> list[str]:
        for name in v:
            if notify_variable(name):
                raise ValueError(
                    f"pass_env: {name} is a notification setting of the supervisor; it never "
                    "reaches a rank"
                )
        return v

    @model_validator(mode="after")
    def _gpu_backend(self) -> JobSpec:
        if self.backend == "nccl" and self.gpus_per_worker == 0:
            raise ValueError("backend nccl needs gpus_per_worker > 0")
        return self

    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if self.gpus_per_worker > 0 else "gloo"

    def resolved_run_dir(self, base: str | os.PathLike[str] = ".") -> Path:
        return Path(base, self.run_dir.replace("{name}", self.name)).resolve()

    def resolved_checkpoints_dir(self, base: str | os.PathLike[str] = ".") -> str | None:
        """``checkpoints.dir`` with ``{name}`` substituted: a local place as an absolute path
        (against ``base``, a ``file://`` URL's path), an object store's URL without a trailing
        ``/``; None when the job leaves it to ``RUN_DIR/checkpoints``."""
        place = self.checkpoints.dir
        if place is None:
            return None
        place = place.replace("{name}", self.name)
        if location.is_local(place):
            return str(Path(base, location.local_path(place)).resolve())
        return place.rstrip("/")


def load_job(path: str | os.PathLike[str], overrides: dict[str, Any] | None = None) -> JobSpec:
    """Load and validate a job file; ``overrides`` (from CLI flags) replace top-level fields.

    Relative ``entrypoint`` and ``policy`` paths are resolved against the job file's folder.
    Raises :class:`spikeguard.policies.PolicyError` (file:line:col: field: message).
    """
    job: JobSpec = load_model_file(JobSpec, path, overrides=overrides, secrets="job file")
    base = Path(path).resolve().parent
    upd: dict[str, Any] = {}
    if not job.entrypoint.startswith("-m ") and not Path(job.entrypoint).is_absolute():
        upd["entrypoint"] = str(base / job.entrypoint)
    if job.policy.endswith((".yaml", ".yml")) and not Path(job.policy).is_absolute():
        upd["policy"] = str(base / job.policy)
    return job.model_copy(update=upd) if upd else job


def load_job_policy(job: JobSpec) -> Policy:
    """The job's policy, its ``notify.routes`` checked against the sinks this supervisor has
    registered (a route to a sink it does not have is a FILE:LINE:COL error before anything
    starts). Raises :class:`spikeguard.policies.PolicyError`."""
    from .sinks import destinations  # the sinks import the world; a job file alone need not

    return load_policy(job.policy, destinations=destinations())
