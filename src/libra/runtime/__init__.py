"""The live mechanism: gateway, engines, sandboxed actions service, elastic replicas, launchers
(local or Ray) and `libra train`.

Heavy dependencies (aiohttp, fastapi, torch, ray) are imported only inside this package, so that
`import libra.sim` stays fast and light.
"""
