"""Which data-parallel ranks are alive and progressing: a heartbeat thread per rank
writes to the rendezvous store (:class:`Heartbeat`), and a failed collective reads
every rank's beats to name the ranks that died or hung."""

from __future__ import annotations

import atexit
import threading
import time
import typing
import weakref

import torch.distributed as dist

if typing.TYPE_CHECKING:
    from .allreduce import GradReducer

__all__ = ["Heartbeat", "stop_heartbeats"]

_LIVE: weakref.WeakSet = weakref.WeakSet()
_CALLS: weakref.WeakSet = weakref.WeakSet()
"""The threads of :func:`_within` still running (each inside a store call)."""
EXIT_WAIT_S = 5.0
"""How long :func:`stop_heartbeats` waits, in all, for store calls still running."""


def _within(fn, seconds: float) -> None:
    """Run ``fn`` (a rendezvous-store call) on a daemon thread for at most ``seconds``:
    a store whose host is gone never answers, and the caller must not wait for it."""
    t = threading.Thread(target=fn, daemon=True, name="rotapipe-store-call")
    _CALLS.add(t)
    t.start()
    t.join(seconds)


@atexit.register
def stop_heartbeats() -> None:
    """Stop every heartbeat thread of this process and wait (at most
    :data:`EXIT_WAIT_S`) for the store calls :func:`_within` left running, before the
    process group goes away and at interpreter exit: a daemon thread that returns from
    a store call while the interpreter shuts down aborts the process ("terminate
    called without an active exception")."""
    for hb in list(_LIVE):
        hb.stop()
    deadline = time.monotonic() + EXIT_WAIT_S
    for t in list(_CALLS):
        if t is not threading.current_thread():
            t.join(max(0.0, deadline - time.monotonic()))


class Heartbeat:
    """Liveness and progress of every rank, through the rendezvous store.

    Each rank's thread writes ``"<beat> <collectives issued>"`` under
    ``rotapipe/<pipeline token>/hb/<global rank>`` every ``interval`` seconds. When a
    collective fails, :meth:`diagnose` reads every rank twice, a few intervals apart: a
    rank whose beat did not move is dead; one whose beat moved but that has not issued
    the failed collective is hung (or left the training loop)."""

    def __init__(self, store, rank: int, interval: float, reducer: GradReducer):
        self.store, self.rank, self.interval = store, rank, interval
        self.reducer = weakref.ref(reducer)
        self.prefix: str | None = None
        self.members = reducer.members
        self._stop = threading.Event()
        self._beat = 0
        self._seen_left = 0
        self.gone: dict[int, int] = {}
        """Ranks that said they left the collectives (:meth:`mark`), with the number of
        collectives each had issued then: one waiting for a later collective fails at
        once (:meth:`left_before`) instead of at the timeout."""
        self._thread: threading.Thread | None = None

    @classmethod
    def start(cls, rank: int, interval: float, reducer: GradReducer) -> Heartbeat | None:
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - no default store: no diagnosis, still exact
            return None
        hb = cls(store, rank, interval, reducer)
        weakref.finalize(reducer, hb._stop.set)
        hb._thread = threading.Thread(target=hb._run, name=f"rotapipe-heartbeat-{rank}",
                                      daemon=True)
        hb._thread.start()
        _LIVE.add(hb)
        return hb

    def stop(self) -> None:
        """Stop beating and wait (bounded) for a store write in flight to finish. A
        daemon thread still inside a C++ store call when the interpreter exits is torn
        down mid-call, and the process aborts ("terminate called without an active
        exception"), so ``close()`` / ``shutdown()`` must not return before it is out."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=2.0 + 2 * self.interval)

    def _key(self, rank: int, what: str = "hb") -> str:
        return f"{self.prefix}/{what}/{rank}"

    def mark(self, why: str) -> None:
        """Tell the other ranks why this one leaves the collectives (bounded: a store
        that does not answer is not waited for)."""
        if self.prefix is None:
            return

        reducer = self.reducer()
        issued = reducer.issued if reducer is not None else -1

        def write():
            try:
                self.store.set(self._key(self.rank, "left"), f"{issued} {why}")
                self.store.add(f"{self.prefix}/left-count", 1)
            except Exception:  # noqa: BLE001 - store gone: diagnose() says so
                pass
        _within(write, 1.0)

    def left_before(self, seq: int) -> list[int]:
        """Ranks that left the collectives before issuing collective ``seq``: they
        never will, so waiting for it is pointless."""
        return sorted(r for r, issued in self.gone.items() if issued <= seq)

    def _watch_left(self) -> None:
        """One store round trip per beat: when a rank has marked itself gone since the
        last look, read how far it got (:attr:`gone`)."""
        count = self.store.add(f"{self.prefix}/left-count", 0)
        if count == self._seen_left:
            return
        self._seen_left = count
        for r in self.members:
            key = self._key(r, "left")
            if r != self.rank and r not in self.gone and self.store.check([key]):
                issued = self.store.get(key).decode().split(" ", 1)[0]
                self.gone[r] = int(issued) if issued.lstrip("-").isdigit() else -1

    def _run(self) -> None:
        # The prefix is agreed on by a collective after the thread starts; the thread
        # only writes once it is known.
        while not self._stop.wait(self.interval if self.prefix else 0.01):
            if self.prefix is None:
                continue
            reducer = self.reducer()
            if reducer is None:
                return
            self._beat += 1
            try:
                self.store.set(self._key(self.rank), f"{self._beat} {reducer.issued}")
                del reducer     # no strong reference while sleeping
                self._watch_left()
            except Exception:  # noqa: BLE001 - store gone; diagnose() reports it
                return

    def _read(self) -> dict[int, tuple[int, int] | None] | None:
        """Every member's (beat, issued); None where missing; None overall when the
        store does not answer within a few intervals."""
        out: dict = {}

        def read():
            for r in self.members:
                try:
                    if self.store.check([self._key(r)]):
                        beat, issued = self.store.get(self._key(r)).decode().split()
                        out[r] = (int(beat), int(issued))
                    else:
                        out[r] = None
                except Exception:  # noqa: BLE001
                    return
            out["ok"] = True

        _within(read, max(2.0, 4 * self.interval))
        return out if out.get("ok") else None

    def _left(self, ranks: list[int]) -> dict[int, str]:
        """``{rank: why}`` of the ranks that said why they left (:meth:`mark`)."""
        out: dict[int, str] = {}

        def read():
            for r in ranks:
                try:
                    if self.store.check([self._key(r, "left")]):
                        # "<collectives issued> <why>" (an older writer: "<why>")
                        text = self.store.get(self._key(r, "left")).decode()
                        head, _, rest = text.partition(" ")
                        out[r] = rest if head.lstrip("-").isdigit() else text
                except Exception:  # noqa: BLE001
                    return
        _within(read, max(2.0, 4 * self.interval))
        return dict(out)

    def diagnose(self, seq: int) -> tuple[list[int], str]:
        if self.prefix is None:
            return [], "the failure came before the ranks agreed on a heartbeat"
        first = self._read()
        time.sleep(3 * self.interval)
        second = self._read()
        if first is None or second is None:
            lost = [self.members[0]] if self.rank != self.members[0] else []
            return lost, ("the rendezvous store does not answer: the process hosting it "
                          "(rank 0, or the torchrun agent of the first node) is gone")
        others = [r for r in self.members if r != self.rank]
        left = self._left(others)
        if left:
            return sorted(left), "; ".join(f"rank {r} left the collectives: {why}"
                                           for r, why in sorted(left.items()))
        dead = [r for r in others if second.get(r) is None or first.get(r) == second.get(r)]
        hung = [r for r in others if r not in dead and second[r][1] <= seq]
        notes = []
        if dead:
            notes.append(f"no heartbeat from rank(s) {dead} for {3 * self.interval:g} s: "
                         "the process died or its machine or network is down")
        if hung:
            notes.append(f"rank(s) {hung} are alive but never issued collective #{seq}: "
                         "stuck in their own work, or they failed and left the training "
                         "loop")
        if not notes:
            notes.append("every rank still beats and has issued the collective: the "
                         "network between them failed")
        return dead + hung, "; ".join(notes)
