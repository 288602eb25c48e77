"""How fast a policy follows a preference switch (the online-learning
experiment, paper Fig. 5): steps from a switch until held-out success, judged
by the new preference, is back to a share of the best it had reached before
(under any earlier preference: a run that never learned the previous style
is measured against the one before).

``evals`` are ``(actor_step, success)`` points in step order; a switch at
``mark`` means evals at steps ``<= mark`` were judged by the old preference
and later ones by the new one.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["RECOVERED_SHARE", "recovery_steps"]

RECOVERED_SHARE = 0.8
"""Recovered = held-out success back to 80% of its best level before the switch."""


def recovery_steps(
    evals: Sequence[tuple[int, float]],
    mark: int,
    *,
    until: int | None = None,
    share: float = RECOVERED_SHARE,
) -> int | None:
    """Actor steps from ``mark`` to the first eval after it whose success is
    ``>= share x`` the best success at or before ``mark`` (and above 0), looking
    no further than ``until`` (the next switch); None when it never gets there,
    or when nothing was learned before the switch (a level of 0)."""
    before = [s for step, s in evals if step <= mark]
    if not before or max(before) <= 0:
        return None
    target = share * max(before)
    for step, s in evals:
        if step > mark and (until is None or step <= until) and s >= target:
            return step - mark
    return None
