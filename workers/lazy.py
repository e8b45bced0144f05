"""Lazy attributes of a package: names resolved from a submodule on first use (PEP 562).

``spikeguard.workers`` and ``spikeguard.workers.checkpoint`` export torch-backed names without
importing torch until one of them is used, so the supervisor imports both on a head node
without torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_attributes(
    package: str, names: dict[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``names`` maps an attribute to the
    submodule (relative to the package) that defines it; a resolved name is cached in
    ``namespace`` (the package's globals)."""

    def getattr_(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", package), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(names))

    return getattr_, dir_
