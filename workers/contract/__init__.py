"""The shared vocabulary of spikeguard: what the launcher, the ranks, the policies and the
supervisor say to each other. Pure Python, no torch, no Ray: the control plane imports it on a
head node without torch.

* :mod:`.env`        the environment variables the launcher sets for each rank
* :mod:`.messages`   the rank -> supervisor message format (types, fields, version)
* :mod:`.signals`    the signal declarations (:class:`SignalSpec`: name, probe, aggregation over
                     layers, metric family, display name) and the stability grades
* :mod:`.plan`       the resume plan the supervisor hands a (re)launched generation
* :mod:`.exitcodes`  the exit codes of the ``spikeguard`` command
* :mod:`.secrets`    the one scanner that recognises secrets (policy, job and environment checks)
"""

from .env import (
    ENV_BACKEND,
    ENV_CKPT_DIR,
    ENV_CKPT_EVERY,
    ENV_FENCE_FILE,
    ENV_GENERATION,
    ENV_REPORT,
    ENV_RESUME,
    ENV_RUN_ID,
    ENV_SAMPLE_EVERY,
    ENV_STANDBY,
    env_int,
)
from .exitcodes import ExitCode
from .messages import FORMAT_VERSION, MESSAGE_TYPES, REQUEST_TYPES, SUPERVISOR_MESSAGE_TYPES
from .plan import ResumePlan
from .secret_scan import find_secret, redact, secret_key, secret_value
from .signals import (
    AGENT_SIGNALS,
    AGGREGATE,
    GRADE_THRESHOLDS,
    LAYER_SIGNALS,
    SIGNALS,
    STEP_SIGNALS,
    MetricFamily,
    SignalSpec,
    declare,
    declared,
    format_grade,
    grade_of,
    parse_grade,
    spec_of,
    specs,
    summarize,
)

__all__ = [
    "AGENT_SIGNALS",
    "AGGREGATE",
    "ENV_BACKEND",
    "ENV_CKPT_DIR",
    "ENV_CKPT_EVERY",
    "ENV_FENCE_FILE",
    "ENV_GENERATION",
    "ENV_REPORT",
    "ENV_RESUME",
    "ENV_RUN_ID",
    "ENV_SAMPLE_EVERY",
    "ENV_STANDBY",
    "FORMAT_VERSION",
    "GRADE_THRESHOLDS",
    "LAYER_SIGNALS",
    "MESSAGE_TYPES",
    "REQUEST_TYPES",
    "SIGNALS",
    "STEP_SIGNALS",
    "SUPERVISOR_MESSAGE_TYPES",
    "ExitCode",
    "MetricFamily",
    "ResumePlan",
    "SignalSpec",
    "declare",
    "declared",
    "env_int",
    "find_secret",
    "format_grade",
    "grade_of",
    "parse_grade",
    "redact",
    "secret_key",
    "secret_value",
    "spec_of",
    "specs",
    "summarize",
]
