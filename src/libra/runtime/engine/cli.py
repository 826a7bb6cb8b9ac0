"""`libra serve engine`: run the built-in CPU engine, or write a checkpoint of its weights.

Only click is imported at module level, so `libra serve engine --help` stays quick; torch and
aiohttp load when the command actually runs. Options are validated into `EngineConfig` before
anything starts, so a bad value is one line naming the option and exit code 2.
"""

from __future__ import annotations

import socket

import click

from libra.core.config import build
from libra.core.errors import ConfigError


def _presets() -> list[str]:
    # The presets live with the model; importing config pulls in pydantic only, not torch.
    from libra.runtime.engine.config import PRESETS

    return sorted(PRESETS)


@click.command("engine")
@click.option(
    "--model", default="tiny", show_default=True, type=click.Choice(_presets()), help="Model preset."
)
@click.option("--checkpoint", type=click.Path(exists=True, dir_okay=False), default=None, help="Load weights from a local state_dict file.")  # fmt: skip
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
@click.option("--access-log", is_flag=True, help="Log every HTTP request.")
def engine(save_checkpoint: str | None, host: str, port: int, access_log: bool, **options) -> None:
    """Built-in CPU inference engine: a small torch transformer with continuous batching and a
    paged KV cache, behind an OpenAI-compatible API. For CI and laptops; not a vLLM replacement."""
    from libra.runtime.engine.config import EngineConfig

    try:
        cfg = build(EngineConfig, options)
    except ConfigError as e:  # name the option the user typed, not the model field
        raise ConfigError("--" + e.field.replace("_", "-"), e.value, e.allowed) from None
    if save_checkpoint:
        _save(cfg, save_checkpoint)
        return
    sock = _bind(host, port)  # before torch loads, so a busy port fails in a fraction of a second
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from libra.runtime.engine.server import serve

    serve(cfg, sock, access_log)


def _bind(host: str, port: int) -> socket.socket:
    try:
        return socket.create_server((host, port), backlog=4096, dualstack_ipv6=False)
    except OSError as e:
        raise ConfigError("--port", port, f"a free port on {host} ({e.strerror})") from None


def _save(cfg, path: str) -> None:
    from libra.runtime.engine.model import build_model, save_checkpoint

    model = build_model(cfg.preset, cfg.seed, cfg.checkpoint)
    try:
        out = save_checkpoint(model, path)
    except OSError as e:
        raise ConfigError("--save-checkpoint", path, f"a writable path ({e.strerror})") from None
    n = sum(t.numel() for t in model.state_dict().values())
    click.echo(f"wrote {cfg.model} weights ({n:,} parameters, seed {cfg.seed}) to {out}")
