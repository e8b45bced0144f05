"""How long this rank computed in a step: its forward passes and the phases the script marks.

In synchronous data parallelism every rank's step takes as long as the slowest rank's (the fast
ones wait in the gradient all-reduce), so the time between two ``step()`` calls is the same on
every rank. What tells the ranks apart is the time each one spends on its own work:

* **forward**: the attached model's root forward, from a pre-hook (run first) to a post-hook
  (run last, also when the forward raises), summed over the step's forwards (gradient
  accumulation). A model held by ``DistributedDataParallel`` is timed inside the wrapper, so the
  buffer broadcast DDP does before a forward (a collective) is left out. On CUDA the hooks record
  CUDA events on the current stream (a CPU clock would measure the kernel launches) and
  ``step()`` reads those that are done without synchronising: a forward whose end event is not
  done yet counts into a later step's reading, so nothing ever waits on the GPU.
* **backward is not timed**: under DDP it holds the all-reduce waits, and separating them takes
  a communication hook (one per DDP model: it would refuse the script's own) or a hook per
  parameter (a cost that grows with the model, an event per parameter on CUDA).
* **phases** the script marks (``with sg.phase("data"):``): CPU wall time (``perf_counter``),
  summed per step by name; the ``data`` phase (:data:`~..contract.messages.OWN_PHASES`) also
  counts into ``step_time``, since loading a batch is the rank's own work.

A model whose forward itself communicates (FSDP, FSDP2's ``fully_shard``, tensor-parallel
``DTensor`` parameters: all-gathers inside the forward, where a fast rank waits for a slow one)
has no honest forward time: ``step_time`` is then absent (said once, at its first forward),
unless the script marks a ``data`` phase, which is reported alone.

Never blocks, never raises into training: a few ``perf_counter`` calls (or event records) a
forward and a dict update a phase. Pure of I/O but the one warning.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ..contract.logs import logger
from ..contract.messages import MAX_PHASES, MAX_STEP_TIME_S, OWN_PHASES, is_phase_name

log = logger(__name__)

MAX_PENDING = 64
"""The most CUDA forwards kept waiting for their end event (older ones are let go uncounted)."""

_COMMUNICATING = ("FSDPModule", "FullyShardedDataParallel")
"""Classes (by name, anywhere in a module's MRO) whose forward communicates with the peers."""


def forward_communicates(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward holds collectives a fast rank waits in for a slow one: an FSDP
    or FSDP2 module in it, or a ``DTensor`` parameter (tensor parallel)."""
    for m in model.modules():
        if any(c.__name__ in _COMMUNICATING for c in type(m).__mro__):
            return True
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


def timed_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose forward is timed: the model a ``DistributedDataParallel`` wraps (its
    ``module``), else ``model`` itself."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.module
    return model


def _clamp(seconds: float) -> float:
    """``seconds`` within what the supervisor reads ([0, ``MAX_STEP_TIME_S``]; a phase left
    open for days is still a timing)."""
    return min(max(seconds, 0.0), MAX_STEP_TIME_S)


def _check_name(name: str) -> None:
    """Raise ValueError unless ``name`` is a phase name (a script's bug, said at its first
    use)."""
    if not is_phase_name(name):
        raise ValueError(
            f"a phase name is a letter or '_' then up to 31 of [A-Za-z0-9_.-], got {name!r}"
        )


class _Phase:
    """One phase's ``with`` block (see :meth:`StepTimer.phase`)."""

    __slots__ = ("_name", "_timer")

    def __init__(self, timer: StepTimer, name: str) -> None:
        self._timer, self._name = timer, name

    def __enter__(self) -> None:
        self._timer.phase_start(self._name)

    def __exit__(self, *exc: object) -> None:
        self._timer.phase_stop(self._name)


class StepTimer:
    """The forward hooks and phase clocks of one rank (see the module docstring).

    :meth:`take` at each ``step()`` returns the step's ``step_time`` and ``phases`` and starts
    the next step's; :meth:`pause` / :meth:`resume` leave out forwards that are no training step
    (a framework's validation)."""

    def __init__(
        self, model: torch.nn.Module, *, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self._clock = clock
        """The CPU clock, in seconds (``time.perf_counter``)."""
        self._module = timed_module(model)
        self._handles = [
            self._module.register_forward_pre_hook(self._pre, prepend=True),
            self._module.register_forward_hook(self._post, always_call=True),
        ]
        self.measurable: bool | None = None
        """Whether the forward can be timed honestly (None until the first forward decides)."""
        self._cuda = False
        self._paused = False
        self._depth = 0
        """Root forwards open now (a forward calling the model again is timed once)."""
        self._t0 = 0.0
        self._seconds = 0.0
        """CPU-timed forward seconds of the step so far."""
        self._forwards = 0
        """Forwards finished in the step (0: the step ran none, no forward time to say)."""
        self._start: Any = None
        """The open CUDA forward's start event."""
        self._pending: list[tuple[Any, Any]] = []
        """(start, end) CUDA events of forwards not read yet, oldest first."""
        self._phases: dict[str, float] = {}
        self._open: dict[str, float] = {}
        """Phase name -> its start (``perf_counter``) while it is open."""
        self._names_warned = False
        self._valid: set[str] = set()
        """Phase names already checked (:data:`~..contract.messages.PHASE_NAME`)."""
        self._blocks: dict[str, _Phase] = {}
        """Phase name -> its ``with`` block (:meth:`phase`)."""

    # -- forward ---------------------------------------------------------------------------
    def _first(self) -> None:
        """The first forward: decide whether it can be timed, and with which clock."""
        try:
            self.measurable = not forward_communicates(self._module)
            param = next(self._module.parameters(), None)
            self._cuda = param is not None and param.is_cuda
        except Exception:  # never into training
            self.measurable = False
        if not self.measurable:
            log.warning(
                "step_time is not measured: the forward of %s communicates with the other ranks "
                "(FSDP, tensor parallel), so its time holds their waits; mark the rank's own "
                'work with sg.phase("data")',
                type(self._module).__name__,
            )

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        """Forward pre-hook: start the clock (outermost forward only)."""
        if self._paused:
            return
        self._depth += 1
        if self._depth != 1:
            return
        if self.measurable is None:
            self._first()
        if not self.measurable:
            return
        if self._cuda:
            try:
                self._start = torch.cuda.Event(enable_timing=True)
                self._start.record()
            except Exception:
                self._start = None
        else:
            self._t0 = self._clock()

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """Forward hook: stop the clock (outermost forward only; also after a raising one)."""
        if self._paused or self._depth == 0:
            return
        self._depth -= 1
        if self._depth != 0 or not self.measurable:
            return
        self._forwards += 1
        if not self._cuda:
            self._seconds += self._clock() - self._t0
            return
        start, self._start = self._start, None
        if start is None:
            return
        try:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        except Exception:
            return
        self._pending.append((start, end))
        if len(self._pending) > MAX_PENDING:
            del self._pending[0]

    def _forward_seconds(self) -> float | None:
        """The forward seconds done since the last call (None: no forward was timed)."""
        if not self._cuda:
            if not self._forwards:
                return None
            seconds, self._seconds = self._seconds, 0.0
            return seconds
        seconds, done = 0.0, 0
        try:
            for start, end in self._pending:  # one stream: they finish in order
                if not end.query():
                    break
                seconds += start.elapsed_time(end) / 1000.0
                done += 1
        except Exception:
            done = len(self._pending)  # unreadable: let them go
        del self._pending[:done]
        return seconds if done else None

    # -- phases ----------------------------------------------------------------------------
    def _admit(self, name: str) -> bool:
        """Whether ``name`` may be clocked this step: raises ValueError for an invalid name (a
        script's bug, said at its first use), False past :data:`MAX_PHASES` names (warned
        once)."""
        if name in self._phases or name in self._open:
            return True
        if name not in self._valid:
            _check_name(name)
            if len(self._valid) < 4 * MAX_PHASES:  # a script naming phases anew each step
                self._valid.add(name)
        if (
            len(self._phases) + len(self._open) < MAX_PHASES
            or len(self._phases.keys() | self._open.keys()) < MAX_PHASES
        ):
            return True
        if not self._names_warned:
            self._names_warned = True
            log.warning(
                "more than %d phase names in one step: %r and later ones are not reported",
                MAX_PHASES,
                name,
            )
        return False

    def phase_start(self, name: str) -> None:
        """Start phase ``name``'s clock (a phase already open keeps its start)."""
        if self._admit(name) and name not in self._open:
            self._open[name] = self._clock()

    def phase_stop(self, name: str) -> None:
        """Stop phase ``name``'s clock: its time counts into the step it stops in (nothing for
        a phase not open)."""
        t0 = self._open.pop(name, None)
        if t0 is not None:
            self._phases[name] = self._phases.get(name, 0.0) + (self._clock() - t0)

    def phase(self, name: str) -> _Phase:
        """``with timer.phase(name):`` clocks the block (:meth:`phase_start`/:meth:`phase_stop`);
        one reusable object a name (a generator-based context manager costs several times
        more a block)."""
        block = self._blocks.get(name)
        if block is None:
            _check_name(name)
            block = _Phase(self, name)
            if len(self._blocks) < 4 * MAX_PHASES:  # a script naming phases anew each step
                self._blocks[name] = block
        return block

    # -- per step --------------------------------------------------------------------------
    def take(self) -> dict[str, Any]:
        """The step's timing fields for its message (``step_time``, ``phases``; each only when
        there is one), and the clocks reset for the next step. Never raises."""
        try:
            return self._take()
        except Exception:  # a timing must never break training
            self._seconds, self._forwards, self._phases = 0.0, 0, {}
            return {}

    def _take(self) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        forward = self._forward_seconds() if self.measurable else None
        self._forwards = 0
        phases, self._phases = self._phases, {}
        if phases:
            own = [phases[p] for p in OWN_PHASES if p in phases]
            if forward is not None or own:
                fields["step_time"] = _clamp((forward or 0.0) + sum(own))
            for name, seconds in phases.items():
                if seconds > MAX_STEP_TIME_S:
                    phases[name] = MAX_STEP_TIME_S
            fields["phases"] = phases
        elif forward is not None:
            fields["step_time"] = _clamp(forward)
        return fields

    def pause(self) -> None:
        """Stop timing forwards until :meth:`resume` (forwards that are no training step)."""
        self._paused = True
        self._depth = 0

    def resume(self) -> None:
        """Time forwards again."""
        self._paused = False

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
