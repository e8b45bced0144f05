"""The MkDocs hook that writes the generated pages of the documentation site (``mkdocs.yml``:
``hooks:``), so that no reference can drift from the code it describes:

- ``reference/cli.md``: every ``spikeguard`` command's ``--help``, walked from the argparse
  parser that ``spikeguard.supervisor.cli.build_parser`` builds;
- ``reference/policy.md`` and ``reference/job.md``: every field of the policy and job-file
  models, from the JSON Schema pydantic derives from their attribute docstrings (the same schema
  ``spikeguard policy schema`` prints);
- the pages that include a README kept beside its code (``deploy/``, ``bench/``, ``policies/``),
  so that text lives in one place.

It also makes the documentation's links to the repository's own files work on the site: a
relative link from a page to a file outside ``docs/`` (``../workers/contract/``, as GitHub shows
it) becomes a link to that file in the repository browser (``repo_url``, from
``$SPIKEGUARD_REPO_URL``), or its path as text when there is none; a link to a repository file
that does not exist is a warning, which ``mkdocs build --strict`` turns into a failure.
"""

from __future__ import annotations

import argparse
import json
import logging
import posixpath
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.gen_reference")
"""Under ``mkdocs``: its warnings count for ``--strict``."""

REPO = Path(__file__).resolve().parents[2]
"""The repository's root (this file is ``docs/hooks/gen_reference.py``)."""
DOCS = "docs"
"""The documentation's folder, relative to the repository's root."""
BRANCH = "main"
"""The branch that repository links point into."""
HELP_WIDTH = 100
"""Columns of the ``--help`` texts in the CLI reference (not the terminal's: reproducible)."""

INCLUDED = {
    "deploy.md": "deploy/README.md",
    "bench-results.md": "bench/README.md",
    "reference/policy-language.md": "policies/README.md",
}
"""Generated page -> the repository file it shows (a README kept beside its code)."""
IMAGES = (".png", ".svg", ".jpg", ".jpeg", ".gif")
"""Link targets an included page shows: copied into the site beside the page."""


# --- the CLI reference --------------------------------------------------------------------


def subcommands(parser: argparse.ArgumentParser) -> Iterator[argparse._SubParsersAction]:
    """The subparser groups of ``parser`` (argparse keeps them among its actions)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield action


def walk_commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = (), text: str = ""
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser, str]]:
    """Every command under ``parser`` (itself first), depth first: its words after
    ``spikeguard``, its parser and its one-line help (``text``, for ``parser`` itself)."""
    yield path, parser, text
    for group in subcommands(parser):
        helps = {a.dest: a.help or "" for a in group._choices_actions}
        for name, sub in group.choices.items():
            yield from walk_commands(sub, (*path, name), helps.get(name, ""))


def help_text(parser: argparse.ArgumentParser) -> str:
    """``parser``'s ``--help``, formatted at :data:`HELP_WIDTH` columns."""
    cls = parser.formatter_class
    parser.formatter_class = lambda prog: cls(prog, width=HELP_WIDTH)  # type: ignore[misc]
    try:
        return parser.format_help().rstrip()
    finally:
        parser.formatter_class = cls


def cli_reference() -> str:
    """The CLI reference page: one section per command, its one-line help and its ``--help``."""
    from spikeguard.supervisor.cli import build_parser

    out = [
        "# CLI reference",
        "",
        "Generated from the argparse parser of "
        "[`supervisor/cli.py`](../../supervisor/cli.py) when the site is built: each command's "
        "`--help`, as `spikeguard COMMAND --help` prints it. Exit codes: "
        "[Running your own job](../jobs.md#exit-codes).",
        "",
    ]
    for words, parser, text in walk_commands(build_parser()):
        title = " ".join(("spikeguard", *words))
        out += [f"## `{title}`", ""]
        if text:
            out += [escape_text(text[:1].upper() + text[1:]) + ".", ""]
        out += ["```text", help_text(parser), "```", ""]
    return "\n".join(out)


# --- the policy and job-file references ---------------------------------------------------


def escape_text(text: str) -> str:
    """Docstring prose as Markdown: RST's ``code`` as `code`; outside code spans, the
    characters Markdown or HTML would read (``<``, ``*``, ``|``) escaped; one line."""
    text = re.sub(r"``(.+?)``", r"`\1`", " ".join(text.split()))
    parts = re.split(r"(`[^`]*`)", text)
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("\\", "\\\\").replace("<", "&lt;").replace("*", "\\*")
    return "".join(parts).replace("|", "\\|")


def anchor(title: str) -> str:
    """The id of a model's section (its heading's text, as MkDocs slugifies it)."""
    return title.lower()


UNIT_PATTERN = re.compile(r"^\^\\d\+ \?(\w+?)s\?\$$")
"""A pattern of the form ``^\\d+ ?steps?$``: a count of that unit."""
TIME_PATTERN = "^(\\d+h)?(\\d+m)?(\\d+(\\.\\d+)?s)?$"
"""The pattern of a time span (``90s``, ``5m``, ``4h``)."""
BOUNDS = {
    "minimum": "≥ {}",
    "exclusiveMinimum": "> {}",
    "maximum": "≤ {}",
    "exclusiveMaximum": "< {}",
    "minLength": "at least {} characters",
    "maxLength": "at most {} characters",
    "minItems": "at least {} items",
}
"""JSON Schema bounds, as the type column says them."""


def type_text(schema: dict[str, Any]) -> str:
    """A field's JSON Schema in a few words, its models linked to their sections."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{anchor(name)})"
    for key in ("anyOf", "oneOf"):
        if key in schema:
            kinds = list(dict.fromkeys(type_text(s) for s in schema[key]))
            return " or ".join(kinds)
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "enum" in schema:
        values = [f"`{json.dumps(v)}`" for v in schema["enum"]]
        return values[0] if len(values) == 1 else "one of " + ", ".join(values)
    kind = schema.get("type")
    if kind == "array":
        text = "list of " + type_text(schema.get("items", {}))
    elif kind == "object":
        keys = schema.get("propertyNames", {})
        key_text = type_text(keys) if keys else "string"
        text = f"mapping of {key_text} to {type_text(schema.get('additionalProperties', {}))}"
    elif kind == "string" and schema.get("pattern") == TIME_PATTERN:
        text = "a time (`90s`, `5m`, `4h`)"
    elif kind == "string" and UNIT_PATTERN.match(schema.get("pattern", "")):
        text = f"`N {UNIT_PATTERN.match(schema['pattern']).group(1)}s`"  # type: ignore[union-attr]
    elif kind == "string" and "pattern" in schema:
        text = f"string matching `{schema['pattern']}`"
    elif isinstance(kind, str):
        text = kind
    else:
        text = "any"
    bounds = [
        "not empty" if k in ("minLength", "minItems") and schema[k] == 1 else fmt.format(schema[k])
        for k, fmt in BOUNDS.items()
        if k in schema
    ]
    return text + (f" ({', '.join(bounds)})" if bounds else "")


def default_text(schema: dict[str, Any], required: bool) -> str:
    """A field's default as the table shows it: ``required``; a model's own fields' defaults
    (its section says them); or the value, as JSON."""
    if required:
        return "required"
    if "default" not in schema:
        return ""
    if isinstance(schema["default"], dict) and "$ref" in json.dumps(schema):
        return "its fields' defaults"
    return f"`{json.dumps(schema['default'], ensure_ascii=False)}`"


def model_sections(schema: dict[str, Any], root: str, root_path: str) -> list[str]:
    """One section per model of ``schema``, the root model first, then each model in the order
    its first field refers to it; each a table of its fields (YAML key, type, default, what)."""
    defs = schema.get("$defs", {})
    order = [root]
    where = {root: root_path}
    models = {root: schema, **defs}
    i = 0
    while i < len(order):
        name = order[i]
        for key, prop in models[name].get("properties", {}).items():
            for ref in re.findall(r'"\$ref": "#/\$defs/(\w+)"', json.dumps(prop)):
                if ref not in where:
                    order.append(ref)
                    suffix = "[]" if prop.get("type") == "array" else ""
                    where[ref] = f"{where[name]}.{key}{suffix}".lstrip(".")
        i += 1
    out: list[str] = []
    for name in order:
        model = models[name]
        out += [f"## {name}", ""]
        if where[name]:
            out += [f"Where: `{where[name]}`.", ""]
        if model.get("description"):
            out += [escape_text(model["description"]), ""]
        out += ["| key | type | default | what |", "|---|---|---|---|"]
        required = set(model.get("required", ()))
        for key, prop in model.get("properties", {}).items():
            default = default_text(prop, key in required)
            what = escape_text(prop.get("description", ""))
            out.append(f"| `{key}` | {type_text(prop)} | {default} | {what} |")
        out.append("")
    return out


def policy_reference() -> str:
    """The policy reference page, from the policy models' JSON Schema."""
    from spikeguard.policies.commands import policy_schema

    schema = policy_schema()
    return "\n".join(
        [
            "# Policy reference",
            "",
            "Every field a policy file may hold, generated when the site is built from the "
            "pydantic models of [`policies/schema.py`](../../policies/schema.py) and "
            "[`policies/conditions.py`](../../policies/conditions.py): their docstrings, as "
            "`spikeguard policy schema` prints them for editors. Unknown fields are an error "
            "(with a did-you-mean). The language (conditions, compact strings, scopes, "
            "persistence, cooldowns) is explained in [the policy language](policy-language.md); "
            "an annotated example is on [Policies](../policies.md).",
            "",
            *model_sections(schema, "Policy", ""),
        ]
    )


def job_reference() -> str:
    """The job-file reference page, from the job model's JSON Schema."""
    from spikeguard.supervisor.job import JobSpec

    schema = JobSpec.model_json_schema()
    return "\n".join(
        [
            "# Job file reference",
            "",
            "Every field of a job file (`spikeguard submit job.yaml`), generated when the site "
            "is built from the pydantic models of [`supervisor/job.py`](../../supervisor/job.py) "
            "and their docstrings. Unknown fields, and a secret anywhere in the file, are errors. "
            "A walk-through: [Running your own job](../jobs.md).",
            "",
            *model_sections(schema, "JobSpec", ""),
        ]
    )


GENERATED = {
    "reference/cli.md": cli_reference,
    "reference/policy.md": policy_reference,
    "reference/job.md": job_reference,
}
"""Generated page -> the function that writes it."""


# --- links to the repository's files ------------------------------------------------------

LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^()\s]+)\)")
"""A Markdown link or image: ``[text](target)``, ``![alt](target)``."""
FENCE = re.compile(r"^(```|~~~)")


def outside_code(markdown: str, change: Any) -> str:
    """``markdown`` with ``change`` applied to each stretch of text between fenced code blocks
    (a link's text may span lines)."""
    out: list[str] = []
    prose: list[str] = []
    fenced = False
    for line in markdown.split("\n"):
        if FENCE.match(line.lstrip()):
            if not fenced and prose:
                out.append(change("\n".join(prose)))
                prose = []
            fenced = not fenced
            out.append(line)
        elif fenced:
            out.append(line)
        else:
            prose.append(line)
    if prose:
        out.append(change("\n".join(prose)))
    return "\n".join(out)


def is_external(target: str) -> bool:
    """A link this hook leaves alone: a URL, an anchor, a site-absolute path."""
    return bool(re.match(r"^[a-z][a-z0-9+.-]*:", target)) or target.startswith(("#", "/"))


def repo_link(path: str, text: str, repo_url: str | None) -> str:
    """A link to the repository file ``path``: into the repository browser, or its path as text
    when the site has no ``repo_url``."""
    if repo_url:
        return f"[{text}]({repo_url.rstrip('/')}/blob/{BRANCH}/{path})"
    return text if text.startswith("`") else f"{text} (`{path}`)"


def rewrite_links(
    markdown: str,
    source: str,
    page: str,
    repo_url: str | None,
    images: dict[str, str] | None = None,
) -> str:
    """``markdown``, written at the repository path ``source``, with its relative links made to
    work from the site page ``page`` (its path inside ``docs/``): a link into ``docs/`` becomes
    relative to the page (MkDocs checks it), a link to a README the site includes goes to its
    page, a link elsewhere in the repository goes to :func:`repo_link`, and an image elsewhere
    is recorded in ``images`` (site path -> repository path) to be copied into the site. A
    target that does not exist is a warning."""
    page_dir = posixpath.dirname(page)

    def one(m: re.Match[str]) -> str:
        bang, text, target = m.groups()
        if is_external(target):
            return m.group(0)
        path, _, frag = target.partition("#")
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(source), path))
        if resolved.startswith("../") or resolved == "..":
            log.warning(f"{source}: the link {target!r} leaves the repository")
            return m.group(0)
        hash_ = f"#{frag}" if frag else ""
        if resolved == DOCS or resolved.startswith(DOCS + "/"):
            inside = posixpath.relpath(resolved, DOCS)
            return f"{bang}[{text}]({posixpath.relpath(inside, page_dir or '.')}{hash_})"
        shown = {src: p for p, src in INCLUDED.items()}.get(resolved)
        if shown is not None:  # a README this site includes: its page
            return f"{bang}[{text}]({posixpath.relpath(shown, page_dir or '.')}{hash_})"
        if not (REPO / resolved).exists():
            log.warning(f"{source}: the link {target!r} names {resolved}, which does not exist")
            return m.group(0)
        if bang:
            if images is None or not resolved.endswith(IMAGES):
                log.warning(f"{source}: the image {target!r} is outside {DOCS}/: move it there")
                return m.group(0)
            site_path = posixpath.join("_repo", resolved)
            images[site_path] = resolved
            return f"![{text}]({posixpath.relpath(site_path, page_dir or '.')})"
        return repo_link(resolved + ("/" if target.endswith("/") else ""), text, repo_url)

    return outside_code(markdown, lambda text: LINK.sub(one, text))


def included_page(page: str, source: str, repo_url: str | None) -> tuple[str, dict[str, str]]:
    """The page ``page`` that shows the repository file ``source``: its text, its links
    rewritten, with a line under its title saying where it lives; and the images it shows
    (site path -> repository path)."""
    title, _, rest = (REPO / source).read_text(encoding="utf-8").partition("\n")
    images: dict[str, str] = {}
    body = rewrite_links(rest, source, page, repo_url, images)
    where = repo_link(source, f"`{source}`", repo_url)
    return f"{title}\n\n*This page is {where}, as it is in the repository.*\n{body}", images


# --- the MkDocs events ---------------------------------------------------------------------


def on_files(files: Files, config: Any) -> Files:
    """Add the generated pages (and the images the included ones show) to the site."""
    repo_url = config.get("repo_url")
    for page, make in GENERATED.items():
        files.append(File.generated(config, page, content=make()))
    for page, source in INCLUDED.items():
        content, images = included_page(page, source, repo_url)
        files.append(File.generated(config, page, content=content))
        for site_path, repo_path in images.items():
            if files.get_file_from_path(site_path) is None:
                files.append(File.generated(config, site_path, abs_src_path=str(REPO / repo_path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Make a page's links to the repository's files (outside ``docs/``) work on the site."""
    if page.file.src_uri in INCLUDED:
        return markdown  # rewritten from where its source lives, in on_files
    source = posixpath.join(DOCS, page.file.src_uri)
    return rewrite_links(markdown, source, page.file.src_uri, config.get("repo_url"))
