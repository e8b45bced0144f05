"""Load a policy from YAML, with every error mapped to FILE:LINE:COL and a field path.

The YAML dialect is a safe, boring subset: only ``true``/``false`` are booleans (``yes``, ``no``,
``on``, ``off`` stay strings), ``1e-3`` is a float, ``010`` is ten, dates stay strings, duplicate
keys are an error, and any tag beyond the plain types (``!!python/object``, ``!custom``) is refused.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml
from pydantic import BaseModel, ValidationError
from spikeguard.workers.contract.secret_scan import Finding, secret_key, secret_value

from .limits import MAX_DEPTH, MAX_FILE_BYTES, int_problem, read_capped, too_large_text
from .schema import DESTINATIONS, Policy
from .values import show, suggest

M = TypeVar("M", bound=BaseModel)

BUILTINS = ("default", "conservative", "aggressive")
MAX_NODES = 100_000

_Y = "tag:yaml.org,2002:"
_PLAIN_TAGS = {_Y + t for t in ("str", "int", "float", "bool", "null", "seq", "map")}
_FLOAT_RE = re.compile(
    r"""^(?:[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9]+[eE][-+]?[0-9]+|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""",
    re.X,
)
_INT_RE = re.compile(r"^(?:[-+]?[0-9]+|0x[0-9a-fA-F]+|0o[0-7]+)$")


class _PolicyLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2-style core resolvers and constructors."""

    yaml_implicit_resolvers: ClassVar[dict] = {
        k: [
            (tag, rx)
            for tag, rx in v
            if tag.rsplit(":", 1)[-1] not in ("bool", "float", "int", "timestamp")
        ]
        for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.depth = 0
        """How many collections enclose the node being composed."""
        self.nodes = 0
        """How many nodes were composed so far."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        """Compose the next node, refusing a collection nested deeper than ``MAX_DEPTH`` before
        the composer's recursion gets there, and a document of more than ``MAX_NODES`` nodes
        before composing the rest of it."""
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise _Refused(self.peek_event().start_mark, _too_many())
        if not self.check_event(yaml.SequenceStartEvent, yaml.MappingStartEvent):
            return super().compose_node(parent, index)
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise _Refused(self.peek_event().start_mark, _too_deep())
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_yaml_int(self, node: yaml.Node) -> int:  # type: ignore[override]
        text = str(self.construct_scalar(node))  # type: ignore[arg-type]
        if text.startswith(("0x", "0o")):
            return int(text, 0)
        return int(text)

    def construct_yaml_float(self, node: yaml.Node) -> float:  # type: ignore[override]
        text = str(self.construct_scalar(node)).lower()  # type: ignore[arg-type]
        return float(text.replace(".inf", "inf").replace(".nan", "nan"))


_PolicyLoader.add_implicit_resolver(
    _Y + "bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_PolicyLoader.add_implicit_resolver(_Y + "int", _INT_RE, list("-+0123456789"))
_PolicyLoader.add_implicit_resolver(_Y + "float", _FLOAT_RE, list("-+0123456789."))
_PolicyLoader.add_constructor(_Y + "int", _PolicyLoader.construct_yaml_int)
_PolicyLoader.add_constructor(_Y + "float", _PolicyLoader.construct_yaml_float)


class _Refused(Exception):
    """A limit of :mod:`.limits` hit while composing, at ``mark``."""

    def __init__(self, mark: Any, message: str) -> None:
        super().__init__(message)
        self.mark, self.message = mark, message


def _too_deep() -> str:
    return f"nested more than {MAX_DEPTH} levels"


def _too_many() -> str:
    return f"the document has more than {MAX_NODES} nodes (too many aliases?)"


@dataclasses.dataclass(frozen=True)
class PolicyIssue:
    """One problem in a policy file."""

    file: str
    line: int | None
    col: int | None
    path: str
    message: str

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}:{self.col}"
        return f"{where}: {self.path + ': ' if self.path else ''}{self.message}"


class PolicyError(Exception):
    """A policy could not be loaded; ``str()`` is ``FILE:LINE:COL: path: message`` (the first
    issue)."""

    def __init__(self, issues: list[PolicyIssue]) -> None:
        self.issues = issues
        first = issues[0]
        self.file, self.line, self.col, self.path, self.message = (
            first.file,
            first.line,
            first.col,
            first.path,
            first.message,
        )
        super().__init__(str(first))

    def __str__(self) -> str:
        return str(self.issues[0])


def _fail(file: str, mark: Any, msg: str, path: str = "") -> PolicyError:
    line, col = (mark.line + 1, mark.column + 1) if mark is not None else (None, None)
    return PolicyError([PolicyIssue(file, line, col, path, msg)])


def format_path(path: tuple) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _null(node: yaml.Node) -> bool:
    """A scalar that reads as null or the empty string (``token: null`` holds no secret)."""
    return isinstance(node, yaml.ScalarNode) and (node.tag == _Y + "null" or node.value == "")


class _Positions:
    """Walks the composed YAML tree: records where every key and value is, refuses pitfalls."""

    def __init__(self, file: str, secrets: str | None) -> None:
        self.file, self.secrets = file, secrets
        self.keys: dict[tuple, yaml.Node] = {}
        self.values: dict[tuple, yaml.Node] = {}
        self.count = 0

    def walk(self, node: yaml.Node, path: tuple) -> None:
        self.count += 1
        if self.count > MAX_NODES:
            raise _fail(self.file, node.start_mark, _too_many())
        self.values.setdefault(path, node)
        if isinstance(node, yaml.CollectionNode) and len(path) >= MAX_DEPTH:
            # deeper than the composer allows: only an alias (a recursive one, say) gets here
            raise _fail(self.file, node.start_mark, _too_deep() + " (through an alias)")
        if node.tag not in _PLAIN_TAGS:
            tag = node.tag.replace(_Y, "!!")
            raise _fail(
                self.file,
                node.start_mark,
                f"tag {tag!r} is not allowed in a policy (only plain "
                "strings, numbers, true/false, null, lists and mappings)",
                format_path(path),
            )
        if isinstance(node, yaml.ScalarNode):
            if node.tag == _Y + "int":
                problem = int_problem(node.value)
                if problem is not None:
                    raise _fail(self.file, node.start_mark, problem, format_path(path))
            what = secret_value(node.value) if self.secrets else None
            if self.secrets and what:
                finding = Finding(path, in_key=False, what=what)
                raise _fail(
                    self.file, node.start_mark, finding.message(self.secrets), format_path(path)
                )
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self.walk(item, path + (i,))
        elif isinstance(node, yaml.MappingNode):
            seen: dict[Any, yaml.Node] = {}
            for key_node, value_node in node.value:
                if key_node.tag == _Y + "merge":
                    raise _fail(
                        self.file,
                        key_node.start_mark,
                        "merge keys (<<) are not supported in a policy: write the keys out",
                        format_path(path),
                    )
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != _Y + "str":
                    raise _fail(
                        self.file,
                        key_node.start_mark,
                        "keys must be plain names, got "
                        + (
                            f"{key_node.value!r}"
                            if isinstance(key_node, yaml.ScalarNode)
                            else "a list or mapping"
                        ),
                        format_path(path),
                    )
                key = key_node.value
                if key in seen:
                    raise _fail(
                        self.file,
                        key_node.start_mark,
                        f"duplicate key {key!r} (first at line "
                        f"{seen[key].start_mark.line + 1}); YAML would silently keep the last one",
                        format_path(path),
                    )
                seen[key] = key_node
                if self.secrets and secret_key(key) and not _null(value_node):
                    finding = Finding((*path, key), in_key=True, what="a secret")
                    raise _fail(
                        self.file,
                        key_node.start_mark,
                        finding.message(self.secrets),
                        format_path(path + (key,)),
                    )
                self.keys[path + (key,)] = key_node
                self.walk(value_node, path + (key,))

    def locate(self, loc: tuple, data: Any, at_key: bool) -> tuple[yaml.Node | None, tuple, int]:
        """The node for a pydantic error location (skipping union tags), its data path, an
        offset."""
        path: tuple = ()
        offset = 0
        cur = data
        rest = list(loc)
        while rest:
            part = rest.pop(0)
            if part == "<offset>" and rest:
                offset = int(rest.pop(0))
                continue
            if (isinstance(cur, dict) and part in cur) or (
                isinstance(cur, list) and isinstance(part, int) and 0 <= part < len(cur)
            ):
                cur, path = cur[part], path + (part,)
        node = self.values.get(path)
        if at_key or (isinstance(node, yaml.CollectionNode) and not node.flow_style):
            node = self.keys.get(path) or node  # a block list or mapping: point at its key
        while node is None and path:
            path = path[:-1]
            node = self.values.get(path)
        return node, path, offset


def _display_path(loc: tuple) -> str:
    parts: list = []
    skip = False
    for part in loc:
        if skip:
            skip = False
            continue
        if part == "<offset>":
            skip = True
        elif isinstance(part, int) or not (part.startswith(":") or "[" in part):
            parts.append(part)
    return format_path(tuple(parts))


def _message(err: Any) -> str:
    kind, msg, value = err["type"], err["msg"], err.get("input")
    if kind == "policy":
        return err["ctx"]["msg"]
    if kind == "value_error":
        return str(err.get("ctx", {}).get("error", msg.removeprefix("Value error, ")))
    if kind == "missing":
        return "missing required field"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"expected a whole number, got {show(value)}"
    if kind in ("float_type", "float_parsing"):
        return f"expected a number, got {show(value)}"
    if kind in ("string_type",):
        return f"expected a string, got {show(value)}"
    if kind in ("list_type",):
        return f"expected a list, got {show(value)}"
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        return f"expected a mapping, got {show(value)}"
    if kind == "literal_error":
        return f"expected {err['ctx']['expected']}, got {show(value)}"
    if kind == "string_pattern_mismatch":
        return f"{show(value)} is not a valid name (use letters, digits, - _ . :)"
    if kind.endswith(("than", "than_equal")) or kind in (
        "too_short",
        "too_long",
        "string_too_short",
    ):
        return f"{msg.replace('Input should', 'must')}, got {show(value)}"
    return msg[0].lower() + msg[1:]


def _model_at(model: Any, loc: tuple) -> Any:
    """The pydantic model class a location lands in (best effort: Optional, list, dict, unions)."""
    tp = model
    for part in loc:
        tp = _unwrap(tp)
        origin = typing.get_origin(tp)
        if isinstance(part, int) and origin in (list, tuple, set):
            tp = typing.get_args(tp)[0]
        elif isinstance(tp, type) and issubclass(tp, BaseModel):
            field = tp.model_fields.get(part) or next(
                (f for f in tp.model_fields.values() if f.alias == part), None
            )
            if field is not None:
                tp = field.annotation
        elif origin is dict:
            tp = typing.get_args(tp)[1]
    tp = _unwrap(tp)
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def _unwrap(tp: Any) -> Any:
    while True:
        if typing.get_origin(tp) is typing.Annotated:
            tp = typing.get_args(tp)[0]
        elif typing.get_origin(tp) in (typing.Union, types.UnionType):
            models = [a for a in typing.get_args(tp) if a is not type(None)]
            tp = next(
                (a for a in models if isinstance(a, type) and issubclass(a, BaseModel)), models[0]
            )
        else:
            return tp


def _from_validation(
    e: ValidationError, data: Any, pos: _Positions, file: str, model: Any, overridden: set[str]
) -> PolicyError:
    issues = []
    for err in e.errors(include_url=False):
        loc = tuple(err["loc"]) + tuple(
            err.get("ctx", {}).get("at", ()) if err["type"] == "policy" else ()
        )
        at_key = err["type"] == "extra_forbidden" or (
            err["type"] == "policy" and err["ctx"].get("key")
        )
        message = _message(err)
        if err["type"] == "extra_forbidden" and loc:
            owner = _model_at(model, loc[:-1])
            names = [f.alias or n for n, f in owner.model_fields.items()] if owner else []
            message = f"unknown field {show(loc[-1])}{suggest(loc[-1], names)}"
        path = _display_path(loc)
        if loc and loc[0] in overridden:
            issues.append(
                PolicyIssue(file, None, None, path, message + " (set on the command line)")
            )
            continue
        node, _, offset = pos.locate(loc, data, bool(at_key))
        mark = node.start_mark if node is not None else None
        line, col = (mark.line + 1, mark.column + 1) if mark else (None, None)
        if (
            offset
            and isinstance(node, yaml.ScalarNode)
            and col is not None
            and mark is not None
            and mark.line == node.end_mark.line
        ):
            col += offset + (1 if node.style in ("'", '"') else 0)
        issues.append(PolicyIssue(file, line, col, path, message))
    issues.sort(key=lambda i: (i.line or 0, i.col or 0))
    return PolicyError(issues)


def _parse(text: str, filename: str, secrets: str | None) -> tuple[dict, _Positions]:
    n_bytes = len(text.encode("utf-8", "replace"))
    if n_bytes > MAX_FILE_BYTES:
        raise _fail(filename, None, too_large_text(n_bytes))
    loader = _PolicyLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            raise _fail(filename, None, "the file is empty")
        pos = _Positions(filename, secrets)
        pos.walk(node, ())
        data = loader.construct_document(node)
    except yaml.MarkedYAMLError as e:
        mark, cm = e.problem_mark, e.context_mark
        if cm is not None and (mark is None or "<stream end>" in (e.problem or "")):
            mark = cm  # an unclosed bracket or quote: point where it opened
        problem = (e.problem or e.context or "invalid YAML").strip()
        if e.context and cm is not None and e.problem:
            problem += f" ({e.context.strip()} at line {cm.line + 1}, column {cm.column + 1})"
        raise _fail(filename, mark, f"YAML syntax error: {problem}") from None
    except _Refused as e:
        raise _fail(filename, e.mark, e.message) from None
    except yaml.YAMLError as e:
        raise _fail(filename, None, f"YAML error: {e}") from None
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        raise _fail(
            filename,
            node.start_mark,
            f"expected a mapping (key: value) at the top level, got {show(data)}",
        )
    return data, pos


def load_yaml_text(text: str, filename: str = "<string>") -> dict[str, Any]:
    """The plain data of a YAML mapping, read with this module's safe dialect (no validation)."""
    return _parse(text, filename, secrets=None)[0]


def load_model_text(
    model: type[M],
    text: str,
    filename: str = "<string>",
    *,
    overrides: dict[str, Any] | None = None,
    secrets: str | None = None,
    context: dict[str, Any] | None = None,
) -> M:
    """Validate YAML ``text`` against any pydantic ``model`` with this module's safe loader.

    ``overrides`` replace top-level fields (command-line flags); errors in them say so instead
    of pointing into the file. ``secrets`` (the kind of file, e.g. ``"job file"``) refuses
    secret-looking keys and values, naming that kind in the error. ``context`` is pydantic's
    validation context (what the caller lets the file name, e.g. :data:`.schema.DESTINATIONS`).
    """
    data, pos = _parse(text, filename, secrets)
    overrides = dict(overrides or {})
    _merge(data, overrides)
    try:
        return model.model_validate(data, context=context)
    except ValidationError as e:
        raise _from_validation(e, data, pos, filename, model, set(overrides)) from None


def _merge(data: dict[str, Any], overrides: dict[str, Any]) -> None:
    """Apply ``overrides`` onto ``data``: a mapping merges into a mapping (``--address`` sets
    ``ray.address`` and keeps the file's other ``ray`` settings), anything else replaces."""
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            _merge(data[key], value)
        else:
            data[key] = value


def load_model_file(
    model: type[M],
    path: str | Path,
    *,
    overrides: dict[str, Any] | None = None,
    secrets: str | None = None,
) -> M:
    """:func:`load_model_text` on a file; unreadable files raise :class:`PolicyError` too."""
    return load_model_text(model, _read(path), str(path), overrides=overrides, secrets=secrets)


def load_policy_text(
    text: str, filename: str = "<string>", *, destinations: Sequence[str] | None = None
) -> Policy:
    """Parse and validate a policy from YAML text; raises :class:`PolicyError`.

    ``destinations``: the names ``notify.routes`` may use (a supervisor's sinks); None: those of
    the default routes (:data:`.schema.DEFAULT_DESTINATIONS`)."""
    context = None if destinations is None else {DESTINATIONS: tuple(destinations)}
    return load_model_text(Policy, text, filename, secrets="policy file", context=context)


def _read(path: str | Path, hint: str = "") -> str:
    """The text of a policy or job file; every way it cannot be read is a :class:`PolicyError`."""
    try:
        return read_capped(path)
    except FileNotFoundError:
        raise _fail(str(path), None, f"no such file{hint}") from None
    except IsADirectoryError:
        raise _fail(str(path), None, "is a directory, not a file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise _fail(
            str(path), None, f"cannot read: {e.strerror if isinstance(e, OSError) else e}"
        ) from None
    except ValueError as e:  # larger than the cap
        raise _fail(str(path), None, str(e)) from None


def builtin_path(name: str) -> Any:
    return resources.files(__package__).joinpath(f"{name}.yaml")


def load_policy(source: str | Path, *, destinations: Sequence[str] | None = None) -> Policy:
    """Load a policy file, or a built-in policy by name (default, conservative, aggressive);
    ``destinations`` as in :func:`load_policy_text`."""
    if isinstance(source, str) and source in BUILTINS and not Path(source).exists():
        text, filename = builtin_path(source).read_text(encoding="utf-8"), f"<builtin {source}>"
    else:
        hint = ""
        if isinstance(source, str) and "/" not in source and not Path(source).suffix:
            hint = f"; the built-in policies are {', '.join(BUILTINS)}{suggest(source, BUILTINS)}"
        text, filename = _read(source, hint), str(source)
    return load_policy_text(text, filename, destinations=destinations)


__all__ = [
    "BUILTINS",
    "PolicyError",
    "PolicyIssue",
    "load_model_file",
    "load_model_text",
    "load_policy",
    "load_policy_text",
    "load_yaml_text",
]
