"""The compact one-line condition form, parsed by a small recursive-descent grammar (no eval).

A rule may write ``when: "grade < S3"`` instead of ``when: {signal: grade, below: S3}``. The
string is turned into exactly the mapping form and then validated like any mapping, so both
forms mean the same thing. Grammar (keywords are lower case)::

    expr       := term ("or" term)*
    term       := factor ("and" factor)*
    factor     := "(" expr ")" | "crash" | "hang" [">" TIME] | test
    test       := SIGNAL ("<" | ">") (NUMBER | GRADE)                   threshold
                | SIGNAL ("<" | ">") NUMBER "*" "median" "(" WINDOW ")"  ratio to trailing median
                | "zscore" "(" SIGNAL "," WINDOW ")" ("<" | ">") NUMBER  robust z-score
                | SIGNAL ("drops" | "rises") "by" NUMBER "within" WINDOW change
                | SIGNAL "is" "nonfinite"                              NaN or infinity
    WINDOW     := COUNT ["samples" | "steps"]   (bare count: samples for per-layer signals,
                                                 steps for loss / grad_norm / lr)

Examples: ``grade < S3``, ``attn_entropy_min_norm < 0.5 * median(20)``,
``loss > 1.5 * median(50 steps) and zscore(loss, 50 steps) > 4``,
``grade drops by 3 within 2 samples``, ``loss is nonfinite or grad_norm is nonfinite``,
``crash or hang > 5m``. Comparisons are strict (``<`` and ``>`` only), like ``below``/``above``.
"""

from __future__ import annotations

import re
from typing import Any, NoReturn

from spikeguard.workers.contract.signals import LAYER_SIGNALS

from .values import fail

MAX_LENGTH = 500
MAX_DEPTH = 16

_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<time>(?=\d)(?:\d+h)?(?:\d+m)?(?:\d+(?:\.\d+)?s)?(?<=[hms])(?![A-Za-z0-9_.]))
  | (?P<number>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?(?![A-Za-z_]))
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op><=|>=|==|!=|[<>*(),])
""",
    re.VERBOSE,
)


class _Tok:
    __slots__ = ("kind", "pos", "text")

    def __init__(self, kind: str, text: str, pos: int) -> None:
        self.kind, self.text, self.pos = kind, text, pos


def _lex(text: str) -> list[_Tok]:
    toks, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            _error(text, pos, f"unexpected character {text[pos]!r}")
        if m.lastgroup != "space":
            toks.append(_Tok(m.lastgroup or "", m.group(), pos))
        pos = m.end()
    toks.append(_Tok("end", "", len(text)))
    return toks


def _error(text: str, pos: int, msg: str) -> NoReturn:
    fail(f"cannot parse condition {text!r} at column {pos + 1}: {msg}", ("<offset>", pos))


def _trailing(d: dict[str, Any]) -> bool:
    return "window" in d


def parse(text: str) -> dict[str, Any]:
    """Parse a compact condition into its mapping form (raises a policy validation error)."""
    if len(text) > MAX_LENGTH:
        fail(f"condition is longer than {MAX_LENGTH} characters; use the mapping form")
    p = _Parser(text)
    out = p.expr(0)
    if p.peek().kind != "end":
        p.bad("expected 'and', 'or' or the end of the condition")
    return out


class _Parser:
    def __init__(self, text: str) -> None:
        self.text, self.toks, self.i = text, _lex(text), 0

    def peek(self) -> _Tok:
        return self.toks[self.i]

    def next(self) -> _Tok:
        tok = self.toks[self.i]
        self.i += 1
        return tok

    def bad(self, msg: str, tok: _Tok | None = None) -> None:
        tok = tok or self.peek()
        got = f"'{tok.text}'" if tok.kind != "end" else "the end"
        _error(self.text, tok.pos, f"{msg}, got {got}")

    def accept(self, text: str) -> bool:
        if self.peek().text == text and self.peek().kind in ("name", "op"):
            self.i += 1
            return True
        return False

    def expect(self, text: str) -> None:
        if not self.accept(text):
            self.bad(f"expected '{text}'")

    def expr(self, depth: int) -> dict[str, Any]:
        if depth > MAX_DEPTH:
            self.bad("conditions nested too deeply")
        parts = [self.term(depth)]
        while self.accept("or"):
            parts.append(self.term(depth))
        return parts[0] if len(parts) == 1 else {"any": parts}

    def term(self, depth: int) -> dict[str, Any]:
        parts = [self.factor(depth)]
        while self.accept("and"):
            part = self.factor(depth)
            prev = parts[-1]
            if (
                _trailing(prev)
                and _trailing(part)
                and prev["signal"] == part["signal"]
                and prev["window"] == part["window"]
                and not set(prev) & set(part) - {"signal", "window"}
            ):
                parts[-1] = {**prev, **part}  # 'x > 1.5 * median(W) and zscore(x, W) > 4': one test
            else:
                parts.append(part)
        return parts[0] if len(parts) == 1 else {"all": parts}

    def factor(self, depth: int) -> dict[str, Any]:
        if self.accept("("):
            inner = self.expr(depth + 1)
            self.expect(")")
            return inner
        tok = self.peek()
        if tok.kind != "name":
            self.bad("expected a signal, 'crash', 'hang', 'zscore(...)' or '('")
        if self.accept("crash"):
            return {"crash": True}
        if self.accept("hang"):
            if self.accept(">"):
                t = self.next()
                if t.kind != "time":
                    self.bad("expected a time like 30s or 5m", t)
                return {"hang": t.text}
            return {"hang": True}
        if self.accept("zscore"):
            self.expect("(")
            signal = self.next().text
            self.expect(",")
            window = self.window(signal)
            self.expect(")")
            op = self.comparison()
            num_tok = self.peek()
            z = self.number()
            if (op == ">") != (z > 0):
                self.bad("write 'zscore(...) > N' (rise) or 'zscore(...) < -N' (fall)", num_tok)
            return {
                "signal": signal,
                "z_above" if op == ">" else "z_below": abs(z),
                "window": window,
            }
        signal = self.next().text
        if self.accept("is"):
            self.expect("nonfinite")
            return {"signal": signal, "nonfinite": True}
        if self.peek().text in ("drops", "rises"):
            key = "drops_by" if self.next().text == "drops" else "rises_by"
            self.expect("by")
            by = self.number()
            self.expect("within")
            return {"signal": signal, key: by, "within": self.window(signal)}
        op = self.comparison()
        tok = self.peek()
        if tok.kind == "name" and re.fullmatch(r"[Ss]\d+", tok.text):
            self.next()
            return {"signal": signal, "below" if op == "<" else "above": tok.text}
        value = self.number()
        if self.accept("*"):
            self.expect("median")
            self.expect("(")
            window = self.window(signal)
            self.expect(")")
            return {
                "signal": signal,
                "below_median" if op == "<" else "above_median": value,
                "window": window,
            }
        return {"signal": signal, "below" if op == "<" else "above": value}

    def comparison(self) -> str:
        tok = self.peek()
        if tok.text in ("<", ">"):
            self.next()
            return tok.text
        if tok.text in ("<=", ">=", "==", "!="):
            self.bad("comparisons are strict: use '<' or '>'")
        self.bad("expected '<', '>', 'is nonfinite', 'drops by' or 'rises by'")
        return ""

    def number(self) -> float:
        tok = self.next()
        if tok.kind != "number":
            self.bad("expected a number", tok)
        v = float(tok.text)
        return int(v) if v.is_integer() and re.fullmatch(r"[-+]?\d+", tok.text) else v

    def window(self, signal: str) -> str:
        tok = self.next()
        if tok.kind != "number" or not tok.text.isdigit():
            self.bad("expected a whole number of samples or steps", tok)
        unit = "samples" if signal in LAYER_SIGNALS else "steps"
        if self.peek().text in ("samples", "sample", "steps", "step"):
            unit = self.next().text
        return f"{tok.text} {unit}"
