"""The documentation: the site builds with ``mkdocs build --strict`` (a broken link, a missing
page or anchor, a page left out of the nav fails it), its generated references name every CLI
command and every field of the policy and job files, and the README is short and its links
resolve.

The references are written by the MkDocs hook ``docs/hooks/gen_reference.py``; these tests walk
the parser and the models on their own and look for what they find in what the hook wrote.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
HOOK = ROOT / "docs" / "hooks" / "gen_reference.py"
README_MAX_LINES = 260
"""The README fits on a page; the rest is the site's."""


def _hook() -> ModuleType:
    """The MkDocs hook, loaded from its file (it is no package of the project)."""
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[test]')")
    spec = importlib.util.spec_from_file_location("gen_reference", HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _section(page: str, title: str) -> str:
    """The text of the ``## title`` section of a generated page (up to the next one)."""
    heading = f"\n## {title}\n"
    assert heading in page, f"no section {title!r} in the generated page"
    return page.split(heading, 1)[1].split("\n## ", 1)[0]


# --- the site ------------------------------------------------------------------------------


def test_site_builds_with_no_warning(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[test]')")
    pytest.importorskip("material", reason="mkdocs-material is not installed")
    site = tmp_path / "site"
    # NO_MKDOCS_2_WARNING: mkdocs-material's banner about MkDocs 2, printed on every build
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    env.pop("SPIKEGUARD_REPO_URL", None)  # the links to source files as a fresh clone has them
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "WARNING" not in output, output
    for page in ("reference/cli", "reference/policy", "reference/job", "deploy", "bench-results"):
        assert (site / page / "index.html").is_file(), f"{page} was not generated"
    # an image an included README shows is copied beside it
    assert (site / "_repo" / "bench" / "results" / "detection-lead.png").is_file()
    assert not (site / "hooks").exists(), "the hook's source is not part of the site"


def test_a_link_to_a_missing_repository_file_is_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hook = _hook()
    text = "See [the machine](../supervisor/decide/recovery/) and [gone](../supervisor/gone.py)."
    with caplog.at_level(logging.WARNING, logger="mkdocs"):
        out = hook.rewrite_links(text, "docs/page.md", "page.md", "https://example.org/r")
    assert "[the machine](https://example.org/r/blob/main/supervisor/decide/recovery/)" in out
    assert [r.getMessage() for r in caplog.records] == [
        "docs/page.md: the link '../supervisor/gone.py' names supervisor/gone.py, which does not "
        "exist"
    ]
    # without a repository browser the link is its path; an included README is its page
    out = hook.rewrite_links(
        "[`jobs`](../../supervisor/job.py), [deploy](../../deploy/README.md#2-ray-jobs)",
        "docs/a/page.md",
        "a/page.md",
        None,
    )
    assert out == "`jobs`, [deploy](../deploy.md#2-ray-jobs)"


# --- the generated references --------------------------------------------------------------


def _commands(
    parser: argparse.ArgumentParser, words: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every command of ``parser``, walked here on its own (not with the hook's walk)."""
    found = [(words, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, (*words, name))
    return found


def test_the_cli_reference_has_every_command_and_option() -> None:
    from spikeguard.supervisor.cli import build_parser

    page = _hook().cli_reference()
    commands = _commands(build_parser())
    assert len(commands) > 15  # submit ... slack test: the walk found the nested groups
    for words, parser in commands:
        section = _section(page, "`" + " ".join(("spikeguard", *words)) + "`")
        for action in parser._actions:
            for option in action.option_strings:
                assert option in section, f"spikeguard {' '.join(words)}: {option} not shown"


def _models(base: type, package: str) -> list[type]:
    """Every model class with fields derived from ``base`` (the base of a file's models) and
    defined in ``package`` (a subclass elsewhere, such as the recovery machine's view of the
    recovery settings, is not part of the file), by name."""
    out, todo = {}, list(base.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.model_fields and (cls.__module__ + ".").startswith(package + "."):
            out[cls.__name__] = cls
    return [out[name] for name in sorted(out)]


def test_the_policy_reference_has_every_field_of_every_model() -> None:
    import spikeguard.policies.schema  # noqa: F401 (defines the models)
    from spikeguard.policies.base import _Model

    page = _hook().policy_reference()
    models = _models(_Model, "spikeguard.policies")
    names = {m.__name__ for m in models}
    assert {"Policy", "Rule", "RecoverySettings", "RecoveryOverrides", "Trailing"} <= names
    for model in models:
        section = _section(page, model.__name__)
        for name, field in model.model_fields.items():
            key = field.alias or name
            assert f"| `{key}` |" in section, f"{model.__name__}.{key} is not in the reference"


def test_the_job_reference_has_every_field_of_every_model() -> None:
    from spikeguard.supervisor.job import _Strict

    page = _hook().job_reference()
    models = _models(_Strict, "spikeguard.supervisor.job")
    assert {"JobSpec", "Timeouts", "CheckpointRetention"} <= {m.__name__ for m in models}
    for model in models:
        section = _section(page, model.__name__)
        for name, field in model.model_fields.items():
            key = field.alias or name
            assert f"| `{key}` |" in section, f"{model.__name__}.{key} is not in the reference"


# --- the README ----------------------------------------------------------------------------

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)\)")


def _github_slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (outside fenced code)."""
    out, fenced = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"^#{1,6} ", line):
            out.add(_github_slug(line.lstrip("#")))
    return out


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def test_every_relative_link_of_the_readme_resolves() -> None:
    targets = LINK.findall(_prose(README.read_text(encoding="utf-8")))
    assert len(targets) > 20
    for target in targets:
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (ROOT / path) if path else README
        assert file.exists(), f"README.md links {target!r}: {path} does not exist"
        if anchor:
            assert file.suffix == ".md", target
            assert anchor in _anchors(file), f"README.md links {target!r}: no such heading"


def test_the_readme_fits_on_a_page() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move the rest into docs/"


def test_the_readme_keeps_its_two_commands_and_the_system_packages() -> None:
    text = README.read_text(encoding="utf-8")
    # .ci/run runs `make test`, the README's test command; the Makefile has both targets
    assert "make demo    # the supervised demo" in text and "make test    # ruff format" in text
    assert (
        "sudo apt-get install chromium chromium-driver prometheus prometheus-alertmanager" in text
    )
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "make test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
