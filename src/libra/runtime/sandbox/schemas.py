"""Request and response shapes of the actions service.

`/run_code` speaks SandboxFusion's shape, so its clients (verl's reward function among them) work
unchanged: the same request fields with the same defaults (`memory_limit_MB` -1: no limit of its
own; `files` values of null are skipped), and the same response: `status` Success / Failed /
SandboxError, `compile_result` and `run_result` each with `status` Finished / Error /
TimeLimitExceeded. Two optional fields are Libra's own: `output_limit_bytes` (cut each stream
there) and, in responses, `message` naming what was cut or skipped. The session and tool endpoints
are Libra's own, in the same style.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

TOOLS = ("python_tests",)


class RunCodeRequest(BaseModel):
    """SandboxFusion's fields, as strict as SandboxFusion is: `language` is required (it has no
    default there), and its lenient coercions are kept (pydantic's lax mode, as its FastAPI
    server validates: `run_timeout` "10" or true is a number, docs/actions.md)."""

    model_config = ConfigDict(allow_inf_nan=False, extra="ignore")
    code: str
    language: str
    compile_timeout: float = Field(10.0, gt=0)
    run_timeout: float = Field(10.0, gt=0)
    memory_limit_MB: int = Field(-1, description="<= 0: no limit of its own (the service's ceiling holds)")
    stdin: str | None = None
    files: dict[str, str | None] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)
    output_limit_bytes: int | None = Field(None, ge=1, description="Libra: cut each stream here")


class SessionCreate(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")
    memory_mb: int | None = Field(None, ge=16)
    files: dict[str, str | None] = Field(default_factory=dict)


class SessionAction(BaseModel):
    """A command (`{parallel}` is replaced by the cores granted) or a ready tool."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")
    command: str | None = None
    tool: str | None = None
    path: str | None = Field(None, description="python_tests: the test file or directory")
    args: list[str] = Field(default_factory=list, description="python_tests: extra pytest arguments")
    parallel: int | None = Field(None, ge=1, description="The most cores the action can use")
    timeout: float | None = Field(None, gt=0)
    stdin: str | None = None
    files: dict[str, str | None] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)
    kind: str | None = Field(None, max_length=64, description="Groups durations the scheduler learns")

    @model_validator(mode="after")
    def _one_of(self) -> SessionAction:
        if (self.command is None) == (self.tool is None):
            raise ValueError("give exactly one of `command` and `tool`")
        if self.tool is not None and self.tool not in TOOLS:
            raise ValueError(f"tool {self.tool!r} is not known; allowed: {', '.join(TOOLS)}")
        if self.tool == "python_tests" and not self.path:
            raise ValueError("python_tests needs `path`, the test file or directory")
        # They become argv strings, which cannot hold NUL (exec would refuse them).
        for name, text in [("command", self.command), ("path", self.path), *(("args", a) for a in self.args)]:
            if text is not None and "\0" in text:
                raise ValueError(f"`{name}` must not contain a NUL character")
        return self


class ToolCall(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")
    payload: Any = None
    tokens: float | None = Field(None, gt=0)


def command_result(status: str, execution_time: float | None, return_code: int | None, stdout: str,
                   stderr: str) -> dict:  # fmt: skip
    return {"status": status, "execution_time": execution_time, "return_code": return_code,
            "stdout": stdout, "stderr": stderr}  # fmt: skip


def overall_status(results: list[dict]) -> tuple[str, str]:
    """SandboxFusion's rule: an Error anywhere is the sandbox's (its stderr is the message); then a
    time limit or a non-zero return code fails; otherwise it succeeded."""
    for r in results:
        if r["status"] == "Error":
            return "SandboxError", r["stderr"] or ""
    if any(r["status"] == "TimeLimitExceeded" or r["return_code"] != 0 for r in results):
        return "Failed", ""
    return "Success", ""


def run_code_response(status: str, message: str, compile_result: dict | None, run_result: dict | None,
                      files: dict[str, str]) -> dict:  # fmt: skip
    return {"status": status, "message": message, "compile_result": compile_result, "run_result": run_result,
            "executor_pod_name": None, "files": files}  # fmt: skip


def sandbox_error(message: str) -> dict:
    """The answer when the sandbox itself cannot run a request (a missing toolchain, no free uid)."""
    return run_code_response("SandboxError", message, None, None, {})
