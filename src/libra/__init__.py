"""Libra: a resource manager for agentic RL post-training.

Policies (`rollout`, `planner`, `actions`) decide; mechanisms (`sim`, `runtime`) act.
See DESIGN.md in the shared folder and the README for the map.
"""

__version__ = "0.1.0"

from libra import native as _native

_native.install()  # compiled simulator modules only when built from this exact source (libra.native)
