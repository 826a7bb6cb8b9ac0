"""Launchers: how `libra train` starts its processes (`local` subprocesses or `ray` actors)."""

from libra.runtime.launch.base import Handle, Launcher, LaunchError, ProcessSpec
from libra.runtime.launch.factory import make_launcher

__all__ = ["Handle", "LaunchError", "Launcher", "ProcessSpec", "make_launcher"]
