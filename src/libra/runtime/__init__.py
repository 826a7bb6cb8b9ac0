"""The live mechanism: gateway, engines, sandboxed actions service, and (later) a trainer on Ray.

Heavy dependencies (aiohttp, fastapi, torch, ray) are imported only inside this package, so that
`import libra.sim` stays fast and light.
"""
