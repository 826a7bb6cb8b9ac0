"""One registry type for every extension point: routers, planners, systems, workload families,
action systems, scenario kinds and commands.

Why one: each family used to hand-roll a dict, a lookup and its own copy of the `pkg.module:Attr`
import for outside code, with slightly different errors. A `Registry` is a read-only mapping of
short names to entries, declared where the entries are defined; `get` resolves a short name or an
outside dotted path, and every failure is one `ConfigError` naming the config field and listing
what is allowed. An entry may be given lazily as a "module:attr" string (commands, scenario kinds),
so registering it imports nothing heavy.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Generic, TypeVar

from libra.core.errors import ConfigError

T = TypeVar("T")
OUTSIDE = "package.module:Attr"


def import_dotted(path: str, field: str, allowed: Iterable[str] = ()) -> object:
    """The object `path` ("package.module:attr") names: the one import of outside code.
    ConfigError(field) if it is not of that form or does not import."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(field, path, [*allowed, OUTSIDE])
    try:
        obj: object = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(field, path, f"an importable {OUTSIDE} ({e})") from None
    return obj


class Registry(Mapping[str, T], Generic[T]):
    """Short names -> entries of one extension point. Read-only once built (no registration by
    mutation from other modules: an entry is listed where it is defined)."""

    def __init__(
        self, what: str, field: str, entries: Mapping[str, T | str] | Iterable[T] = (), outside: bool = True
    ):
        self.what, self.field, self.outside = what, field, outside
        if isinstance(entries, Mapping):
            self._entries: dict[str, T | str] = dict(entries)
        else:  # classes that carry their own `name`
            self._entries = {getattr(e, "name"): e for e in entries}  # noqa: B009 - typed loosely on purpose

    # Mapping: names and resolved entries
    def __getitem__(self, name: str) -> T:
        entry = self._entries[name]
        if isinstance(entry, str):  # lazy "module:attr"
            entry = self._entries[name] = import_dotted(entry, self.field)  # type: ignore[assignment]
        return entry  # type: ignore[return-value]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def allowed(self) -> list[str]:
        return sorted(self._entries) + ([OUTSIDE] if self.outside else [])

    def get_entry(self, name: str, field: str | None = None) -> T:
        """A registered entry, or outside code by dotted path; ConfigError naming `field` otherwise."""
        field = field or self.field
        if name in self._entries:
            return self[name]
        if self.outside and isinstance(name, str) and ":" in name:
            return import_dotted(name, field, sorted(self._entries))  # type: ignore[return-value]
        raise ConfigError(field, name, self.allowed())

    def build(self, name: str, *args, field: str | None = None, **kwargs):
        """`get_entry(name)(*args, **kwargs)`: the usual way to make one."""
        factory: Callable = self.get_entry(name, field)  # type: ignore[assignment]
        return factory(*args, **kwargs)

    def is_lazy(self, name: str) -> bool:
        return isinstance(self._entries.get(name), str)

    def spec(self, name: str) -> str | None:
        """A lazy entry's "module:attr" (for checks that must not import it)."""
        entry = self._entries.get(name)
        return entry if isinstance(entry, str) else None
