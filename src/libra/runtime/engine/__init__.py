"""The built-in CPU inference engine: a small torch transformer behind an OpenAI-compatible API.

It exists so that the whole live stack (gateway, C-MLFQ routing, tool-calling sessions) runs on a
laptop and in CI with real token generation: a real model, a paged KV cache, continuous batching
and real HTTP. It is not a replacement for vLLM or SGLang; point the gateway at those for real
models. Everything here imports torch, so only `libra.runtime` may import this package.

Layout: `tokenizer` (bytes + special tokens, the chat template), `model` (the transformer),
`kv_cache` (paged blocks), `constraints` (UTF-8 text and the tool-call grammar), `sequence`
(request lifecycle), `scheduler` (what runs each step), `runner` (tensors in, tokens out),
`core` (the engine thread and its control commands), `protocol` + `server` (HTTP, OpenAI's API;
`libra serve engine` in `libra.cli.serve`), `native` (SGLang's /generate), `control` (pause,
weights, resume over HTTP) and `weight_sync` (weight-update groups, both sides).
"""
