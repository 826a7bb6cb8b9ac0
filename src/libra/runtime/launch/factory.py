"""Pick a launcher by name (`libra train --launcher`); Ray is imported only when asked for."""

from __future__ import annotations

from libra.core.errors import ConfigError
from libra.runtime.launch.base import Launcher


def make_launcher(name: str, ray_address: str | None = None, cpus: float = 0.0) -> Launcher:
    if name == "local":
        from libra.runtime.launch.local import LocalLauncher

        return LocalLauncher()
    if name == "ray":
        from libra.runtime.launch.ray import RayLauncher

        return RayLauncher(ray_address, cpus)
    raise ConfigError("--launcher", name, ["local", "ray"])
