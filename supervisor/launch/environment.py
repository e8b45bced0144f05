"""The environment of a rank's process, built explicitly (no Ray, no I/O).

A rank runs the user's script and every library it imports, so it inherits nothing the
supervisor holds in confidence: the agent's environment (on an embedded Ray, the environment
``spikeguard submit`` was started in) minus every variable :func:`~..secrets.withheld` names
(a secret by name or by value, the supervisor's notification settings), plus the job's and the
launcher's variables.

The one credential the supervisor sends on purpose is its checkpoint store's: when the job's
``checkpoints.dir`` is an object store's URL, the values of that store's standard variables
(``AWS_*`` for S3, :data:`spikeguard.workers.checkpoint.location.STORE_VARIABLES`) travel with
each launch, since on a remote cluster the agent's environment is not the supervisor's.

A training script that needs a credential of its own (``HF_TOKEN``, ``WANDB_API_KEY``) gets it
only when the job names it in ``pass_env`` (the supervisor's notification settings never pass),
or reads it from where that library keeps it on disk (``~/.cache/huggingface/token``,
``~/.netrc``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..redaction import notify_variable, withheld


def rank_environment(
    base_env: Mapping[str, str],
    job_env: Mapping[str, str],
    launcher_env: Mapping[str, str],
    passed: Iterable[str] = (),
) -> dict[str, str]:
    """The environment a rank's process starts with.

    ``base_env``: the agent's own environment, filtered: every variable :func:`withheld` names
    is dropped (``SLACK_BOT_TOKEN``, ``SPIKEGUARD_SLACK_*``, ``SPIKEGUARD_PAGER*``,
    ``AWS_SECRET_ACCESS_KEY``, a value shaped like a token or webhook URL, …); ``PATH``,
    ``OMP_NUM_THREADS``, ``HF_HOME`` and the like pass. ``job_env``: what the supervisor sends
    for the rank (the job file's ``env``, which the job loader already refuses secrets in, and
    the torchrun and ``SPIKEGUARD_*`` variables of this launch, and the checkpoint store's
    variables the supervisor holds, credentials included). ``launcher_env``: what the agent
    adds (its report socket). ``passed``: names the job lets through although they look secret
    (the job's ``pass_env``); a notification setting of the supervisor never passes. Later
    mappings win; none of the inputs is changed.
    """
    allowed = {name for name in passed if not notify_variable(name)}
    env = {k: v for k, v in base_env.items() if k in allowed or withheld(k, v) is None}
    env.update(job_env)
    env.update(launcher_env)
    return env
