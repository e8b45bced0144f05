"""The ranks' output on the supervisor's stdout: prefixed, rate-limited per rank, redacted."""

from __future__ import annotations

import io

from spikeguard.supervisor.launch.interface import RankPoll
from spikeguard.supervisor.sinks.rank_output import MAX_LINE_CHARS, RankOutput


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(
    rate: float = 1000.0, secrets: tuple[str, ...] = ()
) -> tuple[RankOutput, io.StringIO, Clock]:
    out, clock = io.StringIO(), Clock()
    return RankOutput(out=out, max_bytes_per_s=rate, clock=clock, secrets=secrets), out, clock


def test_lines_are_prefixed_with_generation_and_rank() -> None:
    forward, out, _ = make()
    forward(RankPoll(rank=1, generation=2, output=("step 10 loss 2.1", "step 20 loss 2.0")))
    assert out.getvalue().splitlines() == [
        "[gen 2 rank 1] step 10 loss 2.1",
        "[gen 2 rank 1] step 20 loss 2.0",
    ]


def test_a_chatty_rank_is_capped_and_the_rest_is_counted_with_the_log_named() -> None:
    forward, out, clock = make(rate=1000.0)
    chatty = tuple(f"{i:04d} " + "x" * 95 for i in range(50))  # 50 lines of 101 bytes each
    forward(RankPoll(rank=0, generation=1, output=chatty))
    forward(RankPoll(rank=3, generation=1, output=("quiet rank still heard",)))
    lines = out.getvalue().splitlines()
    shown = [line for line in lines if line.startswith("[gen 1 rank 0] 00")]
    assert 1 <= len(shown) <= 9  # 1000 bytes/s: nine 101-byte lines at most
    assert "[gen 1 rank 3] quiet rank still heard" in lines
    # The count of what was left out comes once the allowance has room again.
    clock.now = 2.0
    forward(RankPoll(rank=0, generation=1, output=()))
    tail = out.getvalue().splitlines()[-1]
    left = (50 - len(shown)) * 101
    assert tail == (
        f"[gen 1 rank 0] … {left} bytes of output not shown here "
        "(all of it: RUN_DIR/logs/gen001-rank0.log)"
    )


def test_the_agents_own_skipped_bytes_are_reported() -> None:
    forward, out, _ = make()
    forward(RankPoll(rank=2, generation=3, output=("last line",), output_skipped=70000))
    assert "… 70000 bytes of output not shown here" in out.getvalue()
    assert "gen003-rank2.log" in out.getvalue()


def test_long_lines_are_cut_and_secrets_redacted() -> None:
    forward, out, _ = make(rate=1e9, secrets=("xoxb-not-a-real-token-123",))
    forward(
        RankPoll(
            rank=0,
            generation=1,
            output=("token=xoxb-not-a-real-token-123", "y" * (MAX_LINE_CHARS + 10)),
        )
    )
    text = out.getvalue()
    assert "xoxb-not-a-real-token-123" not in text
    assert "(10 chars cut)" in text
