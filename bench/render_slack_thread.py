"""Render docs/slack-thread.png: a faithful mock-up of one incident thread in Slack.

Nothing here is drawn from hand-written text: the script runs the real ``SlackNotifier`` (real
slack-sdk, real HTTP) against the test Slack server ``tests/fakeslack.py`` for a sample incident,
then draws what that server received: the root message as ``chat.update`` left it, every thread
reply's Block Kit blocks, the chart PNG that was uploaded, and, on top, the push notification the
on-call's phone shows (the plain ``text`` fallback of the first root message).

    python3 bench/render_slack_thread.py [--out docs/slack-thread.png]
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import matplotlib
from PIL import Image, ImageDraw, ImageFont

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from fakeslack import TOKEN, FakeSlack, incident_events  # noqa: E402
from spikeguard.supervisor.sinks.slack import SlackNotifier, SlackSettings  # noqa: E402

W, PAD, AVATAR, TEXT_X = 880, 24, 40, 24 + 40 + 12
MAX_W = W - TEXT_X - PAD
FONT_DIR = Path(matplotlib.get_data_path()) / "fonts/ttf"
INK, GREY, LINK, CODE, RULE = "#1d1c1d", "#616061", "#1264a3", "#e01e5a", "#dddddd"
MENTION_NAMES = {"<!subteam^S0ONCALL>": "@ml-oncall"}
EMOJI = {
    "rotating_light": ("⚠", "#e01e5a"),
    "octagonal_sign": ("■", "#d72b3f"),
    "rewind": ("↺", "#1d7ac7"),
    "chart_with_downwards_trend": ("↓", "#2eb67d"),
    "arrows_counterclockwise": ("↻", "#1d7ac7"),
    "hourglass_flowing_sand": ("⚑", "#ecb22e"),
    "white_check_mark": ("✔", "#2eb67d"),
    "sos": ("!", "#e01e5a"),
    "x": ("✘", "#e01e5a"),
    "warning": ("⚠", "#ecb22e"),
    "rocket": ("▲", "#7c3aed"),
    "stop_button": ("■", "#616061"),
    "checkered_flag": ("⚑", "#1d1c1d"),
    "small_blue_diamond": ("◆", "#1d7ac7"),
}
#: Seconds after the incident at which each sample event happens (a realistic recovery).
OFFSETS = (0, 4, 11, 11, 11, 38, 47, 1247)


def font(size: int, style: str = "") -> ImageFont.FreeTypeFont:
    name = {"": "DejaVuSans.ttf", "b": "DejaVuSans-Bold.ttf", "m": "DejaVuSansMono.ttf"}[style]
    return ImageFont.truetype(str(FONT_DIR / name), size)


def capture() -> dict[str, Any]:
    """Run the real notifier on a sample incident; return what Slack received."""
    t0 = dt.datetime(2024, 5, 1, 3, 12, 7, tzinfo=dt.timezone.utc)
    events = incident_events(run="gpt-1b-pretrain")
    for ev, off in zip(events, OFFSETS):
        ev["time"] = (t0 + dt.timedelta(seconds=off)).isoformat()
    with FakeSlack() as fake:
        env = {"SLACK_BOT_TOKEN": TOKEN, "SPIKEGUARD_SLACK_API_URL": fake.api_url}
        s = SlackSettings.from_env(
            channel="#ml-alerts",
            mention="S0ONCALL",
            environ=env,
            runbook_url="https://wiki.example.com/spikeguard/runbook",
            dashboard_url="https://grafana.example.com/d/train",
            min_interval_s=0.0,
        )
        n = SlackNotifier(
            s,
            run="gpt-1b-pretrain",
            journal=lambda e: None,
            run_dir_url="https://runs.example.com/gpt-1b-pretrain",
        )
        for ev in events:
            n.handle(ev)
        assert n.flush(60), "the fake Slack did not receive everything"
        n.close(5)
        assert not fake.violations, fake.violations
        (root,) = fake.roots()
        first = fake.ok_calls("chat.postMessage")[0].params
        return {
            "root": root,
            "replies": fake.replies(root["ts"]),
            "first_text": first["text"],
            "chart": next(iter(fake.files.values())),
            "times": [e["time"] for e in events],
        }


def runs(mrkdwn: str, base: str = "") -> list[tuple[str, str]]:
    """mrkdwn -> [(text, style)]; styles: '' 'b' code link mention emoji:<name> newline."""
    out: list[tuple[str, str]] = []
    pattern = r"(<[^>]+>|`[^`]+`|\*[^*\n]+\*|:[a-z_]+:|\n)"
    for tok in re.split(pattern, mrkdwn):
        if not tok:
            continue
        if tok == "\n":
            out.append(("", "newline"))
        elif tok.startswith("<") and tok in MENTION_NAMES:
            out.append((MENTION_NAMES[tok], "mention"))
        elif tok.startswith("<") and "|" in tok:
            out.append((tok[1:-1].split("|", 1)[1], "link"))
        elif tok.startswith("`"):
            out.append((_unescape(tok[1:-1]), "code"))
        elif tok.startswith("*") and len(tok) > 2:
            out += [(t, "b" if s == "" else s) for t, s in runs(tok[1:-1])]
        elif re.fullmatch(r":[a-z_]+:", tok) and tok[1:-1] in EMOJI:
            out.append((tok[1:-1], "emoji"))
        else:
            out.append((_unescape(tok), base))
    return out


def _unescape(s: str) -> str:
    return s.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")


class Canvas:
    """A tall white page that grows as messages are drawn."""

    def __init__(self) -> None:
        self.img = Image.new("RGB", (W, 6000), "white")
        self.d = ImageDraw.Draw(self.img)
        self.y = 0

    def rich(self, mrkdwn: str, x: int, width: int, size: int = 15, color: str = INK) -> None:
        """Draw wrapped mrkdwn at (x, self.y) and advance self.y."""
        line_h, cx, y = int(size * 1.5), x, self.y
        for text, style in runs(mrkdwn):
            if style == "newline":
                cx, y = x, y + line_h
                continue
            if style == "emoji":
                if cx + size + 4 > x + width:
                    cx, y = x, y + line_h
                sym, bg = EMOJI[text]
                self.d.rounded_rectangle([cx, y + 1, cx + size + 3, y + size + 4], 4, fill=bg)
                self.d.text(
                    (cx + (size + 3) / 2, y + (size + 5) / 2),
                    sym,
                    font=font(size - 3, "b"),
                    fill="white",
                    anchor="mm",
                )
                cx += size + 8
                continue
            f = font(size - 1 if style == "code" else size, {"b": "b", "code": "m"}.get(style, ""))
            fill = {"link": LINK, "code": CODE, "mention": LINK}.get(style, color)
            for word in re.split(r"(\s+)", text):
                if not word:
                    continue
                wlen = f.getlength(word)
                if cx + wlen > x + width and not word.isspace() and cx > x:
                    cx, y = x, y + line_h
                if word.isspace() and cx == x:
                    continue
                if style in ("code", "mention") and not word.isspace():
                    bg = "#f6f6f6" if style == "code" else "#e8f5fa"
                    self.d.rounded_rectangle(
                        [cx - 2, y, cx + wlen + 2, y + size + 5],
                        3,
                        fill=bg,
                        outline="#e0e0e0" if style == "code" else None,
                    )
                self.d.text((cx, y + 1), word, font=f, fill=fill)
                cx += wlen
        self.y = y + line_h

    def blocks(self, blocks: list[dict[str, Any]], x: int = TEXT_X) -> None:
        """Draw Block Kit blocks the way Slack lays them out."""
        for b in blocks:
            if b["type"] == "header":
                self.rich(f"*{b['text']['text']}*", x, MAX_W, size=18)
            elif b["type"] == "section" and "text" in b:
                self.rich(b["text"]["text"], x, MAX_W)
            elif b["type"] == "section":
                col = MAX_W // 2
                for i in range(0, len(b["fields"]), 2):
                    top, bottom = self.y, self.y
                    for j, fld in enumerate(b["fields"][i : i + 2]):
                        self.y = top
                        self.rich(fld["text"], x + j * col, col - 12)
                        bottom = max(bottom, self.y)
                    self.y = bottom + 2
            elif b["type"] == "context":
                self.rich("   ".join(e["text"] for e in b["elements"]), x, MAX_W, 13, GREY)
            self.y += 5

    def message(
        self, when: str, blocks: list[dict[str, Any]], note: str = "", edited: bool = False
    ) -> None:
        """One message: avatar, name, APP badge, time, then its blocks."""
        top = self.y
        self.d.rounded_rectangle([PAD, top + 2, PAD + AVATAR, top + 2 + AVATAR], 8, fill="#4a154b")
        self.d.text(
            (PAD + AVATAR / 2, top + 2 + AVATAR / 2),
            "SG",
            font=font(16, "b"),
            fill="white",
            anchor="mm",
        )
        if note:
            self.d.text((TEXT_X, top), note, font=font(12), fill=GREY)
            top += 18
            self.y = top
        self.d.text((TEXT_X, top), "spikeguard", font=font(15, "b"), fill=INK)
        bx = TEXT_X + font(15, "b").getlength("spikeguard") + 6
        self.d.rounded_rectangle([bx, top + 2, bx + 32, top + 17], 3, fill="#e8e8e8")
        self.d.text((bx + 16, top + 10), "APP", font=font(10, "b"), fill=GREY, anchor="mm")
        stamp = when + ("  (edited)" if edited else "")
        self.d.text((bx + 40, top + 2), stamp, font=font(12), fill=GREY)
        self.y = top + 24
        self.blocks(blocks)
        self.y += 10

    def chart(self, png: bytes, title: str) -> None:
        self.d.text((TEXT_X, self.y), title, font=font(13, "b"), fill=INK)
        self.y += 20
        im = Image.open(io.BytesIO(png)).convert("RGB")
        im = im.resize((520, int(im.height * 520 / im.width)), Image.LANCZOS)
        self.img.paste(im, (TEXT_X, self.y))
        self.d.rectangle(
            [TEXT_X - 1, self.y - 1, TEXT_X + im.width, self.y + im.height], outline=RULE
        )
        self.y += im.height + 16

    def rule(self, label: str) -> None:
        self.d.line([PAD, self.y + 9, W - PAD, self.y + 9], fill=RULE)
        tw = font(13).getlength(label)
        self.d.rectangle([PAD + 10, self.y, PAD + 22 + tw, self.y + 18], fill="white")
        self.d.text((PAD + 16, self.y + 1), label, font=font(13), fill=GREY)
        self.y += 30


def render(data: dict[str, Any], out: Path) -> None:
    c, times = Canvas(), [dt.datetime.fromisoformat(t).strftime("%H:%M:%S") for t in data["times"]]
    c.d.rectangle([0, 0, W, 54], fill="#f8f8f8")
    c.d.text((PAD, 14), "Thread", font=font(18, "b"), fill=INK)
    c.d.text((PAD + 78, 18), "#ml-alerts", font=font(14), fill=GREY)
    c.y = 70
    # the push notification (plain-text fallback of the first root message)
    note = data["first_text"].replace("<!subteam^S0ONCALL>", MENTION_NAMES["<!subteam^S0ONCALL>"])
    c.d.rounded_rectangle([PAD, c.y, W - PAD, c.y + 78], 14, fill="#2b2b2e")
    c.d.text(
        (PAD + 16, c.y + 10),
        f"Slack · #ml-alerts · {times[0]}   (what the on-call's phone shows)",
        font=font(12),
        fill="#b8b8bd",
    )
    top, c.y = c.y, c.y + 30
    c.rich(_escape(note), PAD + 16, W - 2 * PAD - 32, 14, "white")
    c.y = max(c.y, top + 78) + 22
    c.message(times[0], data["root"]["blocks"], edited=bool(data["root"]["updates"]))
    c.chart(data["chart"]["data"], data["chart"]["title"] or "chart")
    c.rule(f"{len(data['replies'])} replies")
    for reply, when in zip(data["replies"], times[1:]):
        note = "Also sent to #ml-alerts" if reply["reply_broadcast"] else ""
        c.message(when, reply["blocks"], note=note)
    c.img.crop((0, 0, W, c.y + 10)).save(out, optimize=True)


def _escape(s: str) -> str:
    return s.replace("*", "∗")  # the notification is plain text: keep stars literal


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "slack-thread.png"))
    p.add_argument("--dump", action="store_true", help="also print the captured blocks as JSON")
    args = p.parse_args(argv)
    data = capture()
    if args.dump:
        print(json.dumps({k: v for k, v in data.items() if k != "chart"}, indent=1, default=str))
    os.makedirs(Path(args.out).parent, exist_ok=True)
    render(data, Path(args.out))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
