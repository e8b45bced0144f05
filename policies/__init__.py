"""spikeguard policies: what a stream of per-rank reports means, and what to do about it.

Pure: pydantic and PyYAML only (no Ray, no torch, nothing from the supervisor).
"""

from .engine import Decision, Engine, replay
from .loader import BUILTINS, PolicyError, PolicyIssue, load_policy, load_policy_text
from .schema import NotifySettings, Policy, RecoverySettings, Rule

__all__ = [
    "BUILTINS",
    "Decision",
    "Engine",
    "NotifySettings",
    "Policy",
    "PolicyError",
    "PolicyIssue",
    "RecoverySettings",
    "Rule",
    "load_policy",
    "load_policy_text",
    "replay",
]
