"""Libra: a resource manager for agentic RL post-training.

Policies (`rollout`, `planner`, `actions`) decide; mechanisms (`sim`, `runtime`) act.
See DESIGN.md in the shared folder and the README for the map.
"""

__version__ = "0.1.0"
