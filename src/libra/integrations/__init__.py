"""Thin adapters for RL frameworks that have no URL to point at Libra.

slime and SkyRL talk HTTP to their router and engines, so they use Libra by changing URLs
(docs/integrations.md). verl's agent loop calls its rollout servers through Ray actor handles, so
`libra.integrations.verl` gives it a handle that generates through Libra's gateway instead. These
modules speak only HTTP to the gateway: they import nothing of Libra's runtime, and nothing of the
framework at import time.
"""
