"""The ``slack`` sink: on when a channel or a webhook is configured, from the job file's
``notify.slack`` first, then the policy's, then the environment (secrets only from the latter).
With ``SLACK_APP_TOKEN`` too, its notifier answers the root messages' buttons (:mod:`.buttons`),
writing their requests into the run directory."""

from __future__ import annotations

from spikeguard.workers.contract.logs import logger

from ..registry import SinkContext, register, repeat_interval_s
from .notifier import SlackNotifier
from .settings import SlackSettings

log = logger(__name__)


def slack_settings(ctx: SinkContext) -> SlackSettings:
    """How this run reaches Slack: the job's target over the policy's, secrets from the
    environment; alerts of the severities the routes send to ``slack``."""
    job_slack, notify = ctx.job.notify.slack, ctx.policy.notify
    return SlackSettings.from_env(
        channel=(job_slack.channel if job_slack else None) or notify.slack.channel,
        mention=(job_slack.mention if job_slack else None) or notify.slack.mention,
        runbook_url=notify.slack.runbook_url,
        dashboard_url=notify.slack.dashboard_url,
        severities=ctx.severities,
        rules=dict(ctx.rules),
        repeat_interval_s=repeat_interval_s(notify, "slack"),
    )


@register("slack")
def slack_sink(ctx: SinkContext) -> SlackNotifier | None:
    """A :class:`SlackNotifier`; None when Slack is not wanted (no channel, no webhook) or is
    configured but not usable (said in one line: the run notifies on the console only)."""
    settings = slack_settings(ctx)
    if not settings.channel and not settings.webhook_url:
        return None
    if settings.problems():
        log.warning(
            "Slack is configured but not usable (%s); notifying on the console only",
            "; ".join(settings.problems()),
        )
        return None
    return SlackNotifier(settings, run=ctx.run_id, journal=ctx.record, run_dir=ctx.run_dir)
