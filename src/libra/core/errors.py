"""Typed errors.

Every error a user can cause is a `LibraError` whose message names the field, the value given and
what is allowed. The CLI turns them into one line and exit code 2; HTTP services into a 4xx with a
JSON body. Nothing else should ever reach a user as a traceback.
"""

from __future__ import annotations

from collections.abc import Iterable


class LibraError(Exception):
    """Base class for errors caused by input (configuration, files, requests)."""


class SimulationError(RuntimeError):
    """An internal invariant of the simulation broke (a bug, not bad input). It lives here, not in
    `libra.sim.kernel`, because a compiled module cannot define an exception class (`libra.sim.native`)."""


class ConfigError(LibraError):
    """A field has a value that is not allowed."""

    def __init__(self, field: str, value: object, allowed: str | Iterable[str]):
        if not isinstance(allowed, str):
            allowed = "one of: " + ", ".join(sorted(str(a) for a in allowed))
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"{field}: got {value!r}; allowed: {allowed}")

    def __reduce__(self):  # picklable: a simulation's error crosses a process boundary (sim.isolation)
        return type(self), (self.field, self.value, self.allowed)


class TraceError(LibraError):
    """A record of a trace file is malformed. Names file:line and the field."""

    def __init__(self, path: str, line: int, field: str, problem: str):
        self.path, self.line, self.field, self.problem = path, line, field, problem
        super().__init__(f"{path}:{line}: field {field!r}: {problem}")

    def __reduce__(self):
        return type(self), (self.path, self.line, self.field, self.problem)


class InfeasibleError(LibraError):
    """No configuration satisfies the constraints (for example a cluster too small for a model)."""
