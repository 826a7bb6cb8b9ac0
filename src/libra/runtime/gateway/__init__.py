"""The live rollout gateway: an OpenAI-compatible HTTP router that applies C-MLFQ to real engines.

Agentic RL frameworks (the verl agent loop, SkyRL, slime, rllm) drive rollouts through OpenAI-style
HTTP calls to vLLM or SGLang servers. This package puts Libra's routing in that path: clients point
their base URL at the gateway, and every turn of every session is routed by the very same
`libra.rollout` router object the simulator uses. The gateway only builds the router's inputs
(a `RouteRequest` from the conversation, `InstanceView`s from its backend pool) and carries the
decision out; it has no policy of its own.

Layout: `config` (the typed configuration and `--backend` specs), `pool` (backends, health checks,
admin state machine), `conversation` (what a request's messages tell the router), `sessions`
(per-session turns, path and context), `upstream` (forwarding, SSE pass-through, retry),
`metrics` (Prometheus), `tree_store` (causal-tree persistence), `server` (the aiohttp app),
`admin` (the admin and session endpoints), `control` (the control plane, broadcast to every engine), `app` (builds and runs it from its config; `libra serve
gateway` is its command line, in `libra.cli.serve`).
"""
