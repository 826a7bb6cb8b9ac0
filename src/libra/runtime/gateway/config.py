"""The gateway's configuration: one typed model, from a YAML file, the command line, or both.

YAML is only a serialisation of `GatewayConfig`; `--backend URL,bucket=NAME,tp=T,max_context=N`
specs and `--set key=value` overrides edit the same data before validation, so every bad value is
caught at start-up as one `ConfigError` line naming the field, the value and what is allowed.

Buckets are what the router reasons about. They are either listed explicitly or derived from the
backends' labels: every backend names its bucket, and the backends of one bucket must agree on its
TP degree and max_context. Buckets are ordered by max_context (bucket 0 is the smallest), which is
the order `libra.rollout` expects.
"""

from __future__ import annotations

import ipaddress
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from libra.core.config import build
from libra.core.errors import ConfigError
from libra.costmodel.efficiency import DEFAULT_ENGINE, EngineName
from libra.rollout.base import Bucket
from libra.rollout.tool_state import SizeThresholds
from libra.runtime.http_limits import HttpLimitFields, RequestCapFields

BACKEND_SPEC = "URL,bucket=NAME,tp=T,max_context=N[,cap=C][,node=K][,name=ID][,api_key=KEY][,control=sglang|vllm][,admin_token=T]"  # fmt: skip
BACKEND_KEYS = ("bucket", "tp", "max_context", "cap", "node", "name", "api_key", "control", "admin_token")


MAX_URL = 2048


MAX_HEADER_TEXT = 256


def header_safe(v: str) -> bool:
    """Text the gateway may send back in an HTTP header: printable (a control character cannot be
    carried) and at most MAX_HEADER_TEXT long. Config names and request ids share this rule."""
    return len(v) <= MAX_HEADER_TEXT and v.isprintable()


def _header_safe(v: str) -> str:
    if not header_safe(v):
        raise ValueError(f"at most {MAX_HEADER_TEXT} printable characters (it is sent in HTTP headers)")
    return v


# Names and keys the gateway sends in HTTP headers (X-Libra-Instance, X-Libra-Bucket,
# Authorization): a control character there would fail every request to the instance.
HeaderText = Annotated[str, AfterValidator(_header_safe)]


def _resolvable(host: str) -> bool:
    """An IP address, or a name the resolver can encode (it refuses empty and over-long labels)."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    try:
        host.encode("idna")
        return True
    except UnicodeError:
        return False


class _Strict(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")


class BackendConfig(_Strict):
    """One OpenAI-compatible server: vLLM, SGLang, the built-in engine, or anything alike."""

    url: str = Field(description="Base URL, e.g. http://10.0.0.5:8000 (a trailing /v1 is dropped).")
    bucket: HeaderText = Field(min_length=1, description="The bucket this instance serves.")
    tp: int | None = Field(None, ge=1, description="Tensor-parallel degree (default: the bucket's).")
    max_context: int | None = Field(None, gt=0, description="Context this instance holds (default: the bucket's).")  # fmt: skip
    cap: int = Field(256, ge=1, description="Outstanding requests at which the router calls it saturated.")
    node: int = Field(0, ge=0, description="Machine index (routers price cross-node moves).")
    name: HeaderText | None = Field(None, min_length=1, description="Instance id (default: host:port).")
    api_key: HeaderText | None = Field(
        None, description="Sent as a Bearer token (default: the client's header)."
    )
    control: Literal["sglang", "vllm"] = Field("sglang", description="The control dialect it speaks (the built-in engine: sglang).")  # fmt: skip
    admin_token: HeaderText | None = Field(None, description="Bearer token of its control calls (default: the caller's header).")  # fmt: skip

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        parts = urlsplit(v.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("an http:// or https:// URL with a host, e.g. http://127.0.0.1:8000")
        try:
            parts.port  # noqa: B018 - raises on a malformed port
        except ValueError:
            raise ValueError("a URL with a numeric port") from None
        if len(v) > MAX_URL or any(c.isspace() or not c.isprintable() for c in v.strip()):
            raise ValueError(f"a URL of at most {MAX_URL} printable characters, without spaces")
        if not _resolvable(parts.hostname):
            raise ValueError("a URL whose host is an IP address or a DNS name (labels of 1 to 63 characters)")
        path = parts.path.rstrip("/").removesuffix("/v1")
        return f"{parts.scheme}://{parts.netloc}{path}"

    @property
    def id(self) -> str:
        return self.name or urlsplit(self.url).netloc


class BucketConfig(_Strict):
    name: HeaderText = Field(min_length=1)
    tp: int = Field(ge=1)
    max_context: int = Field(gt=0)


class HealthConfig(_Strict):
    interval_s: float = Field(1.0, gt=0, description="Seconds between health checks of each backend.")
    timeout_s: float = Field(2.0, gt=0, description="A check that takes longer fails.")
    failures: int = Field(2, ge=1, description="Consecutive failed checks that take an instance out.")
    path: str = Field(
        "/health", pattern=r"^/", description="Health endpoint (vLLM, SGLang and Libra: /health)."
    )


class SessionConfig(_Strict):
    idle_timeout_s: float = Field(600.0, gt=0, description="A session idle this long is ended.")
    max_sessions: int = Field(200_000, ge=1, description="Beyond this, the least recently seen session is ended.")  # fmt: skip
    feed_idle: bool = Field(True, description="Feed sessions ended by idleness to the router's tree.")
    key_header: HeaderText | None = Field(None, min_length=1, description="Another header that names the session.")  # fmt: skip
    key_field: str | None = Field(None, min_length=1, max_length=64, description="Another body field that names the session.")  # fmt: skip


class AffinityConfig(_Strict):
    """Keyless turns that extend an earlier turn go where it ran (`affinity`)."""

    enabled: bool = Field(True, description="Follow prompt prefixes of requests that name no session.")
    block: int = Field(64, ge=1, le=4096, description="Tokens (or characters) per hashed block.")
    capacity: int = Field(100_000, ge=1, description="Block keys remembered (least recently used go first).")


class CostModelConfig(_Strict):
    """What the backends serve on, for the cost model (`libra costmodel report` lists both)."""

    model: str = Field(description="A catalog model, e.g. qwen3-14b.")
    hardware: str = Field(description="A catalog GPU, e.g. a800-80g.")
    engine: EngineName = Field(
        DEFAULT_ENGINE, description="Engine preset for the CPU overhead: vllm-v1 or vllm-v0."
    )


class GatewayConfig(_Strict, HttpLimitFields, RequestCapFields):
    """Everything `libra serve gateway` can be told (YAML keys and `--set` paths); the connection
    limits and request caps are `http_limits`' fields, shared with the engine."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    router: str = Field("cmlfq", description="A registered router name or pkg.module:Class.")
    router_params: dict = Field(default_factory=dict)
    seed: int = 0
    buckets: list[BucketConfig] | None = Field(None, description="Explicit buckets (default: from the backends).")  # fmt: skip
    backends: list[BackendConfig] = Field(default_factory=list)
    models: list[str] = Field(default_factory=list, description="Served model names (default: what backends list).")  # fmt: skip
    tree_path: str | None = Field(None, description="Causal tree file: loaded at start, saved periodically.")
    tree_save_interval_s: float = Field(60.0, gt=0)
    health: HealthConfig = Field(default_factory=HealthConfig)
    sessions: SessionConfig = Field(default_factory=SessionConfig)
    affinity: AffinityConfig = Field(default_factory=AffinityConfig)
    tool_state: SizeThresholds = Field(default_factory=SizeThresholds)
    cost_model: CostModelConfig | None = Field(
        None,
        description="The backends' model and GPU: routers then price placement (spill: cost) and migration.",
    )
    max_body_mb: float = Field(8.0, gt=0, le=4096, description="Largest request body; larger gets 413.")
    connect_timeout_s: float = Field(5.0, gt=0)
    request_timeout_s: float = Field(600.0, gt=0, description="Whole upstream request, generation included.")
    no_instance_wait_s: float = Field(30.0, ge=0, description="How long a request waits for a healthy instance.")  # fmt: skip
    max_connections: int = Field(0, ge=0, description="Upstream connection pool size (0: unlimited).")
    admin_token: HeaderText | None = Field(
        None,
        min_length=1,
        description="When set, control and /admin calls need 'Authorization: Bearer <token>'.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> GatewayConfig:
        if self.buckets is None:
            self.buckets = derive_buckets(self.backends)
        else:
            _check_explicit(self.buckets, self.backends)
        _fill_labels(self.buckets, self.backends)
        ids = [b.id for b in self.backends]
        dup = next((i for i in ids if ids.count(i) > 1), None)
        if dup is not None:
            raise ConfigError("backends", dup, "unique instance names (set name=ID on one of them)")
        return self

    def bucket_list(self) -> list[Bucket]:
        return [Bucket(b.name, b.tp, b.max_context) for b in self.buckets or ()]


def derive_buckets(backends: list[BackendConfig]) -> list[BucketConfig]:
    """One bucket per distinct name; its backends must agree on tp and max_context."""
    if not backends:
        raise ConfigError("backends", [], "at least one --backend URL,bucket=...,tp=...,max_context=... (or explicit buckets)")  # fmt: skip
    found: dict[str, BucketConfig] = {}
    for i, be in enumerate(backends):
        for key in ("tp", "max_context"):
            if getattr(be, key) is None:
                raise ConfigError(f"backends[{i}].{key}", None, f"a value: bucket {be.bucket!r} is not declared, so its backends must give tp and max_context")  # fmt: skip
        b = BucketConfig(name=be.bucket, tp=be.tp, max_context=be.max_context)
        prev = found.setdefault(be.bucket, b)
        if prev != b:
            raise ConfigError(f"backends[{i}]", f"{be.bucket} tp={be.tp} max_context={be.max_context}", f"the same tp and max_context as the bucket's other backends (tp={prev.tp}, max_context={prev.max_context})")  # fmt: skip
    out = sorted(found.values(), key=lambda b: b.max_context)
    _check_order(out)
    return out


def _check_explicit(buckets: list[BucketConfig], backends: list[BackendConfig]) -> None:
    if not buckets:
        raise ConfigError("buckets", [], "at least one bucket")
    names = [b.name for b in buckets]
    if len(set(names)) != len(names):
        raise ConfigError("buckets", names, "unique bucket names")
    buckets.sort(key=lambda b: b.max_context)
    _check_order(buckets)
    for i, be in enumerate(backends):
        if be.bucket not in names:
            raise ConfigError(f"backends[{i}].bucket", be.bucket, names)


def _check_order(buckets: list[BucketConfig]) -> None:
    ctx = [b.max_context for b in buckets]
    if len(set(ctx)) != len(ctx):
        raise ConfigError("buckets.max_context", ctx, "a different max_context for every bucket (buckets are ordered by it)")  # fmt: skip


def _fill_labels(buckets: list[BucketConfig], backends: list[BackendConfig]) -> None:
    """Backends without tp/max_context take their bucket's; a different value is an error."""
    by_name = {b.name: b for b in buckets}
    for i, be in enumerate(backends):
        b = by_name[be.bucket]
        for key in ("tp", "max_context"):
            mine = getattr(be, key)
            if mine is None:
                setattr(be, key, getattr(b, key))
            elif mine != getattr(b, key):
                raise ConfigError(f"backends[{i}].{key}", mine, f"{getattr(b, key)} (bucket {b.name!r})")


def parse_backend_spec(spec: str) -> dict:
    """`URL,bucket=NAME,tp=T,max_context=N,...` into a backend mapping (validated later)."""
    url, *pairs = [p.strip() for p in spec.split(",")]
    out: dict = {"url": url}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in BACKEND_KEYS:
            raise ConfigError("--backend", spec, BACKEND_SPEC)
        out[key] = value.strip()
    return out


def backend_from_spec(spec: str) -> dict:
    """A validated backend mapping from one `--backend` spec; errors name the spec's key."""
    data = parse_backend_spec(spec)
    try:
        return build(BackendConfig, data).model_dump(exclude_none=True)
    except ConfigError as e:
        raise ConfigError(f"--backend {e.field}", e.value, e.allowed) from None


def load_gateway_config(data: dict) -> GatewayConfig:
    return build(GatewayConfig, data)
