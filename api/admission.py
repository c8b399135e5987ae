"""Admission: whether an API call may queue, decided on arrival, and the room it then holds.

An `EngineLoop` keeps an `Admitted` count:
sequences of calls admitted but not yet taken by an engine thread. A call's `Reservation`
holds its room there from arrival until its requests are sent, and gives it back if the
call fails first. The reservation knows only its count, never the object that owns it.
"""

from __future__ import annotations


class QueueFullError(Exception):
    """The waiting queue is at its limit; the server answers 503."""


class EngineDeadError(RuntimeError):
    """The engine thread failed; every request in flight fails with this."""


class Admitted:
    """Sequences of admitted calls not yet taken by an engine thread (event loop only)."""

    def __init__(self):
        self.count = 0

    def reserve(self, num_sequences: int) -> Reservation:
        """Hold room for `num_sequences` here (unchecked: the caller's admit checked it)."""
        self.count += num_sequences
        return Reservation(self, num_sequences)

    def give_back(self, num_sequences: int) -> None:
        self.count -= num_sequences


class Reservation:
    """Queue room that one API call was granted on arrival: held until its requests go to
    an engine thread (`Generation.add`), or given back when the call fails before that.
    Use as `with`: leaving gives back whatever was not sent."""

    def __init__(self, admitted: Admitted, num_sequences: int):
        self.admitted = admitted
        self.num_sequences = num_sequences
        self.held = True

    def release(self) -> None:
        """Give the room back (idempotent; nothing to give once the requests were sent)."""
        if self.held:
            self.held = False
            self.admitted.give_back(self.num_sequences)

    def spend(self, num_sequences: int) -> None:
        """The call's requests are being sent: they stay counted, as in transit, until the
        engine thread takes them."""
        if not self.held or num_sequences != self.num_sequences:
            raise RuntimeError(
                f"a reservation of {self.num_sequences} sequences (held: {self.held}) cannot send {num_sequences}"
            )
        self.held = False

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
