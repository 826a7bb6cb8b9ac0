"""Configuration of the live actions service: one YAML file (`--config`), validated at start.

Every limit a request can ask for has a ceiling here, so no request can raise its own limits past
what the operator allows. The defaults suit one machine: all of its cores, the service's own
Python inside the sandbox (so packages such as pytest are there), SandboxFusion's defaults where
it has them (the whole output of a program, no memory limit of its own below the ceiling), and a
bound on everything a sandbox can hold (memory, processes, disk, output).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from libra.actions.quota import QuotaSpec
from libra.runtime.http_limits import HttpLimitFields


class SandboxConfig(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")
    python: str | None = Field(
        None, description="Interpreter inside the sandbox (default: the service's own)."
    )
    ro_binds: list[str] = Field(default_factory=list, description="Extra host paths visible read-only.")
    memory_mb: int = Field(
        1024, ge=16, description="Memory the scheduler reserves for a /run_code without memory_limit_MB."
    )
    max_memory_mb: int = Field(
        8192,
        ge=16,
        description="Resident memory of an action: the ceiling, and the limit for memory_limit_MB -1.",
    )
    nproc: int = Field(256, ge=8, description="Processes (and threads) one action may run.")
    fsize_mb: int = Field(256, ge=1, description="Largest file an action may write.")
    nofile: int = Field(1024, ge=16, description="Open files per process.")
    disk_mb: int = Field(
        512,
        ge=1,
        description="All a sandbox may store: /workspace, /tmp and its absolute paths (RAM-backed).",
    )
    output_limit_bytes: int = Field(
        32 * 2**20,
        ge=1024,
        description="Per stream: default and ceiling; beyond it output is counted and cut.",
    )
    cgroups: Literal["auto", "off"] = Field(
        "auto",
        description="Limit memory and cores with cgroups where the host allows (off: rlimit and seccomp).",
    )
    default_timeout_s: float = Field(10.0, gt=0)
    max_timeout_s: float = Field(900.0, gt=0)
    uid_base: int | None = Field(
        None, ge=1000, description="First uid of the range sandboxes run under (default: a free range)."
    )
    uid_count: int = Field(4096, ge=2, description="Uids in the range (sessions plus concurrent runs).")
    workdir_root: str | None = Field(
        None, description="Where sandboxes' work dirs live (default: a temp dir)."
    )

    @field_validator("ro_binds")
    @classmethod
    def _absolute(cls, v: list[str]) -> list[str]:
        bad = [p for p in v if not p.startswith("/")]
        if bad:
            raise ValueError(f"paths must be absolute: {bad}")
        return v


class HttpToolConfig(BaseModel):
    """A quota-limited HTTP tool: POSTs the caller's JSON to `url`, within the quota's limits."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")
    url: str = Field(pattern=r"^https?://")
    quota: str = Field(description="Name of a quota under `quotas`.")
    tokens_per_call: float = Field(1.0, gt=0, description="Tokens a call spends when it gives none.")
    timeout_s: float = Field(30.0, gt=0)
    max_response_bytes: int = Field(1_000_000, ge=1024)


class ServiceConfig(HttpLimitFields):
    """The service's settings; the connection limits are `http_limits`' fields, shared with the
    engine and the gateway."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    cores: list[int] | None = Field(
        None, description="CPU ids to run actions on (default: all this process may use)."
    )
    numa: list[list[int]] | None = Field(
        None, description="Cores grouped by NUMA domain (default: from /sys)."
    )
    memory_gib: float | None = Field(None, gt=0, description="Memory for sandboxes (default: 3/4 of RAM).")
    session_memory_mb: int = Field(1024, ge=16, description="Memory a session reserves while it lives.")
    max_sessions: int = Field(1024, ge=1)
    max_queue: int = Field(10_000, ge=1, description="Waiting actions beyond this are refused with 503.")
    max_body_bytes: int = Field(16 * 2**20, ge=1024, description="Largest request body.")
    max_code_bytes: int = Field(4 * 2**20, ge=16, description="Largest `code` or `command`.")
    max_response_bytes: int = Field(
        64 * 2**20,
        ge=4096,
        description="One action's whole response as sent (outputs, then fetched files in base64); beyond it outputs are cut and files not returned.",  # fmt: skip
    )
    max_parallel: int = Field(64, ge=1, description="The most cores one action may be granted.")
    warm_pool: int = Field(
        4, ge=0, le=256, description="Python sandboxes kept started for /run_code (0: none)."
    )
    parallel_profile: dict = Field(
        default_factory=lambda: {"amdahl": 0.05, "units": [1, 2, 4, 8, 16, 32, 64]},
        description="Efficiency of actions with a `parallel` hint (measure yours; see docs).",
    )
    sandbox: SandboxConfig = SandboxConfig()
    quotas: dict[str, QuotaSpec] = Field(default_factory=dict)
    http_tools: dict[str, HttpToolConfig] = Field(default_factory=dict)
