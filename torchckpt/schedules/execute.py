"""The one executor of schedule actions: every runtime and every dry run walks a schedule through it.

# NOTE [ Executor ]
# One schedule drives every runtime (``checkpointed_loop``/``checkpointed_scan`` and ``run_schedule`` in
# torchckpt.adjoint, ``checkpoint_chain`` in torchckpt.recompute) and every dry run (``simulate``, the cache
# and write-back models of prefetch.py, the planner's pricing of Revolve over a chain), with the semantics of
# NOTE [ Schedule actions ]. None of them tests an action's class itself.
# 1. ``execute(action, driver, i)`` dispatches one action (``functools.singledispatch`` on its class) to the
#    *driver*'s method of that action, with the action and its position ``i`` in the stream:
#    ``advance``, ``save``, ``restore``, ``adjoint``, ``prefetch``, ``free``, ``end_forward``, ``end``.
# 2. A method that returns ``False`` stops the walk after its action; any other result goes on. ``End``
#    stops it always, after ``driver.end``. A stopped walk can be resumed by walking the same iterator again
#    (``checkpointed_loop``'s forward stops at ``EndForward`` and its backward goes on from there;
#    ``checkpoint_chain`` walks its stream in pieces, one per block call and per state handed to backward).
# 3. ``Walker`` is a driver whose methods do nothing: a dry run overrides only the actions it reads.
# 4. An object that is not an action raises ``TypeError`` naming it and its position (``driver.unknown``).
# 5. This module imports the actions and nothing else: schedules/ stays pure Python (no torch).
# 6. The loops (``run``, ``walk``, ``bind``) look the driver's methods up once per walk, in a table keyed by
#    the action's exact class (a dict lookup per action instead of ``singledispatch``'s and a ``getattr``);
#    an object of any other class (``End``, a subclass of an action, a non-action) goes through ``execute``,
#    so the results are the same. A driver that rebinds its methods in the middle of a walk is not seen
#    until the next walk.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

from torchckpt.schedules.actions import Action, Adjoint, Advance, End, EndForward, Free, Prefetch, Restore, Save

__all__ = ["Walker", "bind", "execute", "run", "walk"]


class Walker:
    """A driver of every action that does nothing (NOTE [ Executor ] Rule 3); subclasses override what they read."""

    def advance(self, a: Advance, i: int) -> bool | None:
        return None

    def save(self, a: Save, i: int) -> bool | None:
        return None

    def restore(self, a: Restore, i: int) -> bool | None:
        return None

    def adjoint(self, a: Adjoint, i: int) -> bool | None:
        return None

    def prefetch(self, a: Prefetch, i: int) -> bool | None:
        return None

    def free(self, a: Free, i: int) -> bool | None:
        return None

    def end_forward(self, a: EndForward, i: int) -> bool | None:
        return None

    def end(self, a: End, i: int) -> bool | None:
        return None

    def unknown(self, a: Any, i: int) -> TypeError:
        """The error for ``a``, which is not an action (NOTE [ Executor ] Rule 4)."""
        return TypeError(f"torchckpt: unknown schedule action {a!r} at position {i}; a schedule holds actions of "
                         "torchckpt.schedules (Save, Advance, Restore, Adjoint, ...).")


@functools.singledispatch
def execute(action: Action, driver: Any, i: int) -> bool:
    """Execute ``action`` (at position ``i`` of the stream) on ``driver``; False stops the walk
    (NOTE [ Executor ] Rule 2)."""
    unknown = getattr(driver, "unknown", None)
    raise unknown(action, i) if unknown is not None else Walker.unknown(driver, action, i)


def _to(method: str) -> Any:
    """The dispatch of one action class: the driver's ``method`` with the action and its position
    (NOTE [ Executor ] Rules 1-2)."""
    def call(a: Action, driver: Any, i: int) -> bool:
        return getattr(driver, method)(a, i) is not False
    return call


_METHODS: tuple[tuple[type, str], ...] = (
    (Advance, "advance"), (Save, "save"), (Restore, "restore"), (Adjoint, "adjoint"), (Prefetch, "prefetch"),
    (Free, "free"), (EndForward, "end_forward"))
for _cls, _method in _METHODS:
    execute.register(_cls, _to(_method))


def _table(driver: Any) -> dict[type, Callable[[Any, int], Any]]:
    """The driver's methods by the exact class of their action (NOTE [ Executor ] Rule 6); a method the driver
    lacks is left out, so its action goes through ``execute`` (which raises what it always did)."""
    out = {}
    for cls, method in _METHODS:
        f = getattr(driver, method, None)
        if f is not None:
            out[cls] = f
    return out


def bind(driver: Any) -> Callable[[Action, int], bool]:
    """``execute`` with ``driver``'s methods looked up once (NOTE [ Executor ] Rule 6): for a loop of its own.

    Returns:
        A function of ``(action, position)`` returning False where the walk stops.

    Example::

        >>> from torchckpt.schedules import Revolve
        >>> step = bind(Walker())
        >>> [step(a, i) for i, a in enumerate(Revolve(2, 1))][-1]
        False
    """
    get = _table(driver).get

    def step(a: Action, i: int) -> bool:
        f = get(a.__class__)
        return execute(a, driver, i) if f is None else f(a, i) is not False
    return step


@execute.register
def _(a: End, driver: Any, i: int) -> bool:
    driver.end(a, i)
    return False  # NOTE [ Executor ] Rule 2: End stops the walk always


def run(actions: Iterable[tuple[int, Action]], driver: Any) -> bool:
    """Execute ``(position, action)`` pairs until one stops the walk (True) or they run out (False)."""
    get = _table(driver).get  # NOTE [ Executor ] Rule 6
    for i, a in actions:
        f = get(a.__class__)
        if f is None:
            if not execute(a, driver, i):
                return True
        elif f(a, i) is False:
            return True
    return False


def walk(actions: Iterable[Action], driver: Any) -> int:
    """Execute a schedule's actions from position 0 until one stops the walk or they run out.

    Returns:
        How many actions were executed.

    Example::

        >>> from torchckpt.schedules import Revolve
        >>> class Count(Walker):
        ...     advances = 0
        ...     def advance(self, a, i):
        ...         self.advances += a.n1 - a.n0
        >>> c = Count()
        >>> walk(Revolve(10, 3), c), c.advances
        (42, 15)
    """
    get = _table(driver).get  # NOTE [ Executor ] Rule 6
    n = 0
    for n, a in enumerate(actions, 1):
        f = get(a.__class__)
        if f is None:
            if not execute(a, driver, n - 1):
                return n
        elif f(a, n - 1) is False:
            return n
    return n
