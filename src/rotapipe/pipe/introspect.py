"""What a RoundPipe runs and what it cost: its schedules (and the user's own), timelines
of the calls that ran, device memory peaks and the caller's host time (:class:`Inspection`)."""

from __future__ import annotations

from ..config import PinMode
from ..errors import ConfigError, ScheduleError
from ..runtime.calls import timeline
from ..schedule import Schedule, validate
from ..schedule.runnable import check_runnable

__all__ = ["Inspection"]


class Inspection:
    """The schedules, timelines and costs of a :class:`~rotapipe.pipe.RoundPipe`."""

    def schedule(self, training: bool = True) -> Schedule:
        """The schedule a call runs (``Schedule.grid()`` prints it)."""
        self._check_open()
        return self._schedule(training)

    def use_schedule(self, schedule: Schedule) -> None:
        """Run ``schedule`` instead of the generated one for calls of its kind (training
        when its name does not end in ``-eval``), as given: its microbatch count splits
        the batch (it may differ from ``config.microbatches``); such calls run one at a
        time. It must be for this pipeline's plan and worker count (an error names
        both counts otherwise); it is validated (a dry run) first, and it
        must move the model state this pipeline keeps in host memory (weight uploads,
        gradient downloads and hand-offs, side inputs, buffers). The baselines run with
        ``offload_optimizer=True``: build the pipeline with ``plan=bound_plan(...)`` and
        pass e.g. ``one_f_one_b_schedule(pipe.plan, workers, microbatches,
        offload_optimizer=True)``."""
        self._check_open()
        if not isinstance(schedule, Schedule):
            raise ConfigError(f"use_schedule takes a rotapipe Schedule, got "
                              f"{type(schedule).__name__}")
        if schedule.plan != self.plan or schedule.workers != len(self.devices):
            raise ConfigError(f"the schedule is for {schedule.workers} workers and plan "
                              f"{schedule.plan.to_text()}; this pipeline has "
                              f"{len(self.devices)} workers and plan {self.plan.to_text()}")
        validate(schedule)
        try:
            check_runnable(schedule, side_inputs=self.side_inputs is not None,
                           buffer_layers={l: self.layerset.layer_buffers[l]
                                          for l in self.layerset.buffer_layers()},
                           tail_context=self.tail_context is not None)
        except ScheduleError as exc:
            raise ConfigError(str(exc)) from None
        if schedule.calls > 1:
            raise ConfigError(f"the schedule spans {schedule.calls} calls; use_schedule "
                              "takes the schedule of one call (overlapping calls are "
                              "config.optimizer_mode='overlap' or 'stale')")
        training = not schedule.name.endswith("-eval")
        with self._lock:
            self._flush()
            self._user_schedules[training] = schedule
        if self._planner.refiner is not None:   # a schedule of the user's: keep its plan
            self._planner.refiner.frozen = True

    @property
    def pin_mode(self) -> PinMode:
        """The host memory mode of the weights (:class:`rotapipe.PinMode`): the
        configured ``pin``, or what the auto rule chose for ``pin=None``
        (:func:`rotapipe.runtime.pinning.resolve_pin`; docs/host_memory.md).
        ``self.pinning.stats`` counts the bytes of each kind."""
        return self.pinning.mode

    def last_timeline(self, calls: int = 1):
        """When each action of the last training call (or the last ``calls`` calls, as
        one timeline) ran, as a :class:`rotapipe.sim.Timeline` (milliseconds from the
        first action), so the simulator's tools apply to real runs:
        ``rotapipe.sim.trace.write_trace`` (Chrome/Perfetto JSON),
        ``rotapipe.sim.gantt.draw_gantt`` (PNG) and ``rotapipe.sim.report.report``
        (bubble). Calls still in flight are left out (:meth:`flush` completes them).
        Compute actions give the times the device ran them (timing events around
        them); copies and host work the times their bodies ran (on CUDA, when a copy
        was issued). With overlapping calls the timeline's schedule is what
        ran: :func:`rotapipe.schedule.roundpipe_stale_schedule`'s calls. ``None``
        before a training call has completed (evaluation calls are not kept)."""
        self._check_open()
        if isinstance(calls, bool) or not isinstance(calls, int) or calls < 1:
            raise ConfigError(f"last_timeline(calls={calls!r}): use an int >= 1 (the "
                              "last 64 calls are kept)")
        history = list(self._stream.history)[-calls:]
        return timeline(history)

    def peak_memory(self) -> list[int]:
        """Peak accounted device bytes per worker since construction or reset."""
        self._check_open()
        return [d.peak_memory() for d in self.devices]

    def reset_peak_memory(self) -> None:
        self._check_open()
        for d in self.devices:
            d.reset_peak()

    def host_seconds(self) -> dict[str, float]:
        """Seconds the caller's thread has spent in each phase of the training calls
        since construction: ``"wait for the loss"``, ``"wait for the rest of the call"``
        (a call that returns before its backward drained waits here at the next
        call), ``"check, merge and step"`` (what the caller does once every gradient is
        in: the finiteness check, the merge into ``.grad`` and, for a call that ends a
        ``sync`` step, the optimizer step; the asynchronous modes do it on the host
        lane instead), ``"re-plan"`` (``partition="refine"``) and ``"zero_grad"``.
        Differences over a few calls say where a slow step goes on the host side
        (docs/gpu_check.md)."""
        return dict(self._stream.host_seconds)
