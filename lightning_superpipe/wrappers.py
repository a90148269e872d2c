"""Methods of other objects wrapped as instance attributes, for the run's waits around calls Lightning makes
(``zero_grad``, the precision plugin's ``backward``, the hooks of callbacks that may read weights)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional


class WrappedMethod:
    """Calls ``before``, the ``original`` bound method, then ``after``, and returns what the original returned.

    A copy of the object that holds it (``copy.deepcopy``, pickling the Trainer mid-run) gets the original method
    back: the run's waits belong to the object the run wrapped.
    """

    def __init__(
        self,
        original: Callable[..., Any],
        before: Optional[Callable[[], None]] = None,
        after: Optional[Callable[[], None]] = None,
    ) -> None:
        self.original = original
        self.__wrapped__ = original  # what Lightning's `is_overridden` looks at
        self.before = before
        self.after = after

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.before is not None:
            self.before()
        output = self.original(*args, **kwargs)
        if self.after is not None:
            self.after()
        return output

    def __reduce__(self) -> tuple[Any, ...]:
        return _itself, (self.original,)


def _itself(value: Any) -> Any:
    return value


class BeforeCalls:
    """Wraps some objects' methods as instance attributes (:class:`WrappedMethod`): each target is ``(owner, method
    name, before)`` or ``(owner, method name, before, after)``, ``before`` or ``after`` ``None`` for nothing.
    :meth:`detach` puts back what each owner had (its own instance attribute, if any). Attaching or detaching twice is
    harmless."""

    def __init__(self, targets: Sequence[tuple[Any, ...]]) -> None:
        self._targets = list(targets)
        self._wrapped: list[tuple[Any, str, WrappedMethod, Any]] = []

    def attach(self) -> None:
        if self._wrapped:
            return
        for owner, name, before, *after in self._targets:
            own = vars(owner).get(name)
            wrapper = WrappedMethod(getattr(owner, name), before=before, after=after[0] if after else None)
            vars(owner)[name] = wrapper
            self._wrapped.append((owner, name, wrapper, own))

    def detach(self) -> None:
        for owner, name, wrapper, own in self._wrapped:
            if vars(owner).get(name) is wrapper:
                if own is None:
                    del vars(owner)[name]
                else:
                    vars(owner)[name] = own
        self._wrapped = []
