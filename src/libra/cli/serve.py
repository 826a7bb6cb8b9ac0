"""`libra serve gateway|engine|actions`: live services. Each lives in `libra.runtime` and needs the
`serve` extra (the engine also `train`, for torch).

This module only parses arguments into each service's typed config; the service's own code
(`runtime/gateway/app.py`, `runtime/engine/server.py`, `runtime/sandbox/app.py`) builds and runs
it. Heavy imports (aiohttp, torch) happen only when a service actually starts, so `--help` stays
quick and a missing extra is one clear line.
"""

from __future__ import annotations

import functools

import click

from libra.cli.common import set_option_for
from libra.core.config import apply_overrides, build, load_model, load_yaml
from libra.core.errors import ConfigError
from libra.runtime.gateway.config import BACKEND_SPEC  # pydantic only: no aiohttp, no torch


def _needs_extra(fn):
    """A missing optional dependency is one line naming the extra, not a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ModuleNotFoundError as e:
            if e.name and e.name.split(".")[0] == "libra":
                raise
            if e.name and e.name.split(".")[0] in HF_MODULES:
                raise ConfigError("model", kwargs.get("model"), f"the 'hf' extra installed (missing module {e.name!r}): pip install 'libra[hf]'") from None  # fmt: skip
            raise ConfigError(
                "serve",
                fn.__name__,
                f"the 'serve' extra installed (missing module {e.name!r}): pip install 'libra[serve,train]'",
            ) from None

    return wrapper


# What a checkpoint model needs beyond the engine itself (the `hf` extra).
HF_MODULES = {"transformers", "safetensors", "gguf", "tokenizers", "accelerate", "peft"}


@click.group()
def serve() -> None:
    """Run a live service: gateway, engine or actions."""


# ---- gateway ------------------------------------------------------------------------------------


@serve.command("gateway")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None, help="Gateway YAML (see docs/gateway.md).")  # fmt: skip
@click.option("--host", default=None, help="Address to bind [default: 127.0.0.1].")
@click.option("--port", type=click.IntRange(0, 65535), default=None, help="Port; 0 picks a free one (printed at start) [default: 8000].")  # fmt: skip
@click.option("--backend", "backends", multiple=True, metavar=BACKEND_SPEC, help="An OpenAI-compatible backend (repeatable); adds to the file's backends.")  # fmt: skip
@click.option(
    "--router", default=None, help="Router: a registered name or pkg.module:Class [default: cmlfq]."
)
@click.option("--tree-path", default=None, type=click.Path(dir_okay=False), help="Causal tree file: loaded at start, saved periodically and at shutdown.")  # fmt: skip
@click.option("--admin-token", default=None, envvar="LIBRA_ADMIN_TOKEN", help="Control calls (pause, weights) and /admin need 'Authorization: Bearer TOKEN' [env: LIBRA_ADMIN_TOKEN].")  # fmt: skip
@set_option_for("health.interval_s=2")
@click.option("--log-level", default="info", show_default=True, type=click.Choice(["debug", "info", "warning", "error"]))  # fmt: skip
@click.option("--access-log", is_flag=True, help="Log every HTTP request.")
@click.option("--compiled", is_flag=True, help="Run the routing policy's compiled build (`libra native build`) instead of its Python source.")  # fmt: skip
@_needs_extra
def gateway(
    config_path,
    host,
    port,
    backends,
    router,
    tree_path,
    admin_token,
    overrides,
    log_level,
    access_log,
    compiled,
) -> None:
    """OpenAI-compatible gateway: routes every turn of every session with a Libra router
    (C-MLFQ by default) across vLLM, SGLang or built-in engine instances.

    \b
    Example, in front of two built-in engines (one per bucket), with no file:
        libra serve gateway --port 8000 \\
            --backend http://127.0.0.1:8101,bucket=short,tp=1,max_context=4096 \\
            --backend http://127.0.0.1:8102,bucket=long,tp=2,max_context=8192
    """
    if compiled:
        from libra.sim import native

        ok, why = native.activate()
        if not ok:
            raise ConfigError("--compiled", True, f"a compiled build of these sources ({why})")
    from libra.runtime.gateway import app
    from libra.runtime.gateway.config import backend_from_spec, load_gateway_config

    data = load_yaml(config_path) if config_path else {}
    flags = (
        ("host", host),
        ("port", port),
        ("router", router),
        ("tree_path", tree_path),
        ("admin_token", admin_token),
    )
    for key, value in flags:
        if value is not None:
            data[key] = value
    if backends:
        listed = data.get("backends") or []
        if not isinstance(listed, list):
            raise ConfigError("backends", listed, "a list of backends")
        data["backends"] = listed + [backend_from_spec(s) for s in backends]
    app.run(load_gateway_config(apply_overrides(data, list(overrides))), log_level, access_log)


# ---- engine -------------------------------------------------------------------------------------


def _presets() -> list[str]:
    # The presets live with the model; importing config pulls in pydantic only, not torch.
    from libra.runtime.engine.config import PRESETS

    return sorted(PRESETS)


@serve.command("engine")
@click.option("--model", default="tiny", show_default=True, metavar="PRESET|NAME|DIR|FILE.gguf", help=f"A preset ({', '.join(_presets())}), a packaged model (smollm2-135m, the 'models' extra), a local Hugging Face directory or a GGUF file (Llama, Mistral, Qwen2, Qwen3, SmolLM; the 'hf' extra). See docs/models.md.")  # fmt: skip
@click.option("--checkpoint", type=click.Path(exists=True, dir_okay=False), default=None, help="Load weights from a local state_dict file.")  # fmt: skip
@click.option("--max-model-len", type=click.IntRange(16), default=None, help="Cap the model's context (a checkpoint's is often more than a CPU KV cache holds).")  # fmt: skip
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda[:N]: the model, the KV cache and each step's tensors.")  # fmt: skip
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True, help="Weights and KV cache; auto: float32 on CPU, bfloat16 on CUDA.")  # fmt: skip
@click.option("--save-checkpoint", type=click.Path(dir_okay=False), default=None, help="Write the weights (random from --seed, or --checkpoint) to this file and exit.")  # fmt: skip
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8100, show_default=True, type=click.IntRange(0, 65535), help="0 picks a free port (printed at start).")  # fmt: skip
@click.option("--name", default=None, help="Model name served in /v1/models and expected in requests [default: the preset].")  # fmt: skip
@click.option("--tp-label", default="tp1", show_default=True, help="Label reported by /health and /v1/models (a bucket hint for the gateway).")  # fmt: skip
@click.option("--max-num-seqs", default=64, show_default=True, type=click.IntRange(1, 4096), help="Most sequences in the running batch.")  # fmt: skip
@click.option("--max-tokens-default", default=128, show_default=True, type=click.IntRange(1), help="max_tokens when a request gives none.")  # fmt: skip
@click.option("--max-num-batched-tokens", default=512, show_default=True, type=click.IntRange(16), help="Token budget of one step.")  # fmt: skip
@click.option("--prefill-chunk", default=256, show_default=True, type=click.IntRange(16), help="Most prompt tokens of one sequence per step.")  # fmt: skip
@click.option("--kv-cache-mb", default=256, show_default=True, type=click.IntRange(1), help="KV cache size.")
@click.option(
    "--seed", default=0, show_default=True, type=int, help="Seeds the weights and unseeded requests."
)
@click.option(
    "--threads", default=1, show_default=True, type=click.IntRange(1, 256), help="torch CPU threads."
)
@click.option("--tool-rounds", default=1, show_default=True, type=click.IntRange(0), help="Tool calls an 'auto' turn makes before answering in text.")  # fmt: skip
@click.option("--max-body-mb", default=8.0, show_default=True, type=click.FloatRange(min=0, max=4096, min_open=True), help="Largest request body.")  # fmt: skip
@click.option("--weight-version", default="0", show_default=True, help="Weight version reported until a trainer sets another.")  # fmt: skip
@click.option("--admin-token", default=None, envvar="LIBRA_ADMIN_TOKEN", help="Control calls (pause, weights, flush) need 'Authorization: Bearer TOKEN' [env: LIBRA_ADMIN_TOKEN].")  # fmt: skip
@click.option("--max-prompts-per-request", type=int, default=None, help="Prompts in one batched request [default: 4096].")  # fmt: skip
@click.option("--max-request-tokens", type=int, default=None, help="Tokens one request may queue: prompt plus max_tokens, over its sequences [default: 4194304].")  # fmt: skip
@click.option("--header-timeout-s", type=float, default=None, help="From a request's first byte to the end of its headers [default: 10].")  # fmt: skip
@click.option("--body-timeout-s", type=float, default=None, help="Reading one request's body [default: 60].")  # fmt: skip
@click.option("--idle-timeout-s", type=float, default=None, help="An idle keep-alive connection is closed after this [default: 75].")  # fmt: skip
@click.option("--max-connections-per-client", type=int, default=None, help="Open connections from one IP address [default: 4096].")  # fmt: skip
@click.option("--access-log", is_flag=True, help="Log every HTTP request.")
@click.option("--step-log", type=click.Path(dir_okay=False), default=None, help="Append each step's composition and CPU seconds to this JSONL file (for `libra costmodel profile`).")  # fmt: skip
@_needs_extra
def engine(save_checkpoint: str | None, host: str, port: int, access_log: bool, **options) -> None:
    """Libra's inference engine: continuous batching and a paged KV cache behind an
    OpenAI-compatible API, for the built-in model or a Llama-family checkpoint, on CPU or CUDA.
    For CI, laptops and RL on small models; not a vLLM replacement."""
    from libra.runtime.engine.config import EngineConfig

    options = {k: v for k, v in options.items() if v is not None}  # absent: the config's default
    try:
        cfg = build(EngineConfig, options)
    except ConfigError as e:  # name the option the user typed, not the model field
        raise ConfigError("--" + e.field.replace("_", "-"), e.value, e.allowed) from None
    if save_checkpoint:
        from libra.runtime.engine.server import write_checkpoint

        out, n = write_checkpoint(cfg, save_checkpoint)
        click.echo(f"wrote {cfg.served_name} weights ({n:,} parameters, seed {cfg.seed}) to {out}")
        return
    from libra.runtime.serving import bind

    sock = bind(host, port, "--port")  # before torch loads, so a busy port fails at once
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from libra.runtime.engine.server import serve as serve_engine

    serve_engine(cfg, sock, access_log)


# ---- actions ------------------------------------------------------------------------------------


@serve.command("actions")
@click.option("--host", default=None, help="Address to listen on [default: 127.0.0.1].")
@click.option("--port", type=int, default=None, help="Port to listen on; 0 picks a free one [default: 8080].")
@click.option("--config", type=click.Path(dir_okay=False), default=None, help="Service configuration YAML.")
@click.option(
    "--insecure-no-sandbox",
    is_flag=True,
    help="Run actions without bubblewrap isolation (rlimits and affinity only). Never on shared machines.",
)
@set_option_for("warm_pool=8")
@_needs_extra
def actions(host, port, config, insecure_no_sandbox, overrides):
    """Sandboxed actions service: SandboxFusion /run_code, sessions, quota-limited tools."""
    from libra.runtime.sandbox import app
    from libra.runtime.sandbox.config import ServiceConfig

    flags = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
    cfg = load_model(ServiceConfig, config, [*overrides, *(f"{k}={v}" for k, v in flags.items())])
    app.run(cfg, insecure_no_sandbox)
