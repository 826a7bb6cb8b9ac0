"""A small async client of the actions service, for reward functions and agent loops.

async with ActionsClient("http://127.0.0.1:8080") as c:
    r = await c.run_code("print(1)")                      # SandboxFusion's /run_code
    sid = await c.create_session(files={"sol.py": "..."})  # one sandbox per trajectory
    r = await c.act(sid, tool="python_tests", path="test_sol.py", parallel=4)
    await c.delete_session(sid)
"""

from __future__ import annotations

import base64

import aiohttp


def encode_files(files: dict[str, str | bytes]) -> dict[str, str]:
    return {k: base64.b64encode(v.encode() if isinstance(v, str) else v).decode() for k, v in files.items()}


class ActionsError(RuntimeError):
    """The service refused a request (4xx/5xx); `body` is its JSON answer."""

    def __init__(self, status: int, body: object):
        super().__init__(f"actions service answered {status}: {body}")
        self.status, self.body = status, body


class ActionsClient:
    def __init__(self, base_url: str, timeout_s: float = 3600.0):
        self.base_url = base_url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ActionsClient:
        self._http = aiohttp.ClientSession(timeout=self._timeout)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._http.close()

    async def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        async with self._http.request(method, self.base_url + path, json=body) as r:
            data = await r.json(content_type=None)
            if r.status >= 400:
                raise ActionsError(r.status, data)
            return data

    async def run_code(self, code: str, language: str = "python", run_timeout: float = 10.0, **extra) -> dict:
        return await self._call(
            "POST", "/run_code", {"code": code, "language": language, "run_timeout": run_timeout, **extra}
        )

    async def create_session(
        self, files: dict[str, str | bytes] | None = None, memory_mb: int | None = None
    ) -> str:
        body: dict = {"files": encode_files(files or {})}
        if memory_mb is not None:
            body["memory_mb"] = memory_mb
        return (await self._call("POST", "/sessions", body))["session_id"]

    async def act(self, session_id: str, command: str | None = None, **fields) -> dict:
        body = {k: v for k, v in {"command": command, **fields}.items() if v is not None}
        if "files" in body:
            body["files"] = encode_files(body["files"])
        return await self._call("POST", f"/sessions/{session_id}/actions", body)

    async def delete_session(self, session_id: str) -> None:
        await self._call("DELETE", f"/sessions/{session_id}")

    async def call_tool(self, name: str, payload: object, tokens: float | None = None) -> dict:
        body = {"payload": payload} | ({"tokens": tokens} if tokens is not None else {})
        return await self._call("POST", f"/tools/{name}", body)


class ServiceProcess:
    """`libra serve actions` as a child process on a free loopback port (for scripts and tests).

    with ServiceProcess(config_path) as svc:
        ...  # svc.url is http://127.0.0.1:PORT
    """

    def __init__(
        self, config: str | None = None, extra_args: tuple[str, ...] = (), start_timeout_s: float = 300.0
    ):
        self.config, self.extra_args, self.start_timeout_s = config, extra_args, start_timeout_s
        self.proc = None
        self.url = ""
        self.log: list[str] = []

    def __enter__(self) -> ServiceProcess:
        import subprocess
        import sys
        import threading

        args = [sys.executable, "-m", "libra", "serve", "actions", "--port", "0", *self.extra_args]
        if self.config:
            args += ["--config", self.config]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        found = threading.Event()

        def read() -> None:
            for line in self.proc.stderr:
                self.log.append(line)
                if "listening on " in line and not found.is_set():
                    self.url = line.split("listening on ", 1)[1].split()[0]
                    found.set()
            found.set()

        threading.Thread(target=read, daemon=True).start()
        if not found.wait(self.start_timeout_s) or not self.url:
            self.__exit__()
            raise RuntimeError("the actions service did not start: " + "".join(self.log)[-2000:])
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except Exception:
                self.proc.kill()
                self.proc.wait()
