"""Build caches shared read-only by every sandbox, each seeing them through an overlay of its own.

`go test` with an empty build cache compiles the testing package and testify for every request
(10 s of CPU here, against 0.5 s with a warm cache); SandboxFusion keeps one warm cache that every
run writes into. A cache that sandboxes share and write would let one program plant build output
for the next, so instead the service builds the cache once, from its own warm-up program, into a
directory that is never written again (built under a temporary name, then renamed into place, so
services on one host can share it and no sandbox ever sees it change), and each sandbox that
needs it gets an overlay: reads come from the shared cache, writes go to the sandbox's own
storage (counted in its disk bound) and vanish with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from libra.runtime.sandbox.languages import GO_ENV, GOPATH

# What RL code datasets' Go programs and tests use: the standard packages most of them import and
# testify (Debian's golang-github-stretchr-testify-dev), as SandboxFusion's go_test offers it.
GO_WARMUP = """package main
import (
    "bufio"; "container/heap"; "fmt"; "math"; "os"; "reflect"; "regexp"; "sort"; "strconv"; "strings"
    "testing"; "time"; "unicode"
    "github.com/stretchr/testify/assert"
    "github.com/stretchr/testify/require"
)
var _ = []interface{}{bufio.NewReader, heap.Init, fmt.Sprint, math.Abs, os.Exit, reflect.TypeOf,
    regexp.MustCompile, sort.Ints, strconv.Itoa, strings.Split, time.Now, unicode.IsDigit, assert.Equal, require.Equal}
func TestWarm(t *testing.T) {}
"""
GO_CACHE_PATH = "/var/cache/libra-go"  # where a sandbox sees it (its GOCACHE)


@dataclass(frozen=True, slots=True)
class SharedCache:
    lower: Path  # the read-only shared directory
    sandbox_path: str  # where a sandbox sees its overlay
    env: str  # the variable that points the toolchain at it


def cache_root() -> Path:
    for d in (Path("/var/cache/libra-actions"), Path(tempfile.gettempdir()) / "libra-actions-cache"):
        with contextlib.suppress(OSError):
            d.mkdir(parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
    raise OSError("no writable cache directory")


async def build_go_cache(path: str) -> SharedCache:
    """The warm Go build cache for this Go toolchain (built now unless a service built it before).
    Cancelling it (the service stopping) kills the build."""
    go = shutil.which("go", path=path)
    env = {**dict(GO_ENV), "PATH": path, "HOME": "/nonexistent"}
    version = (await _run([go, "env", "GOVERSION"], env, None)).strip()
    key = hashlib.sha256((version + GO_WARMUP + GOPATH).encode()).hexdigest()[:12]
    final = (await asyncio.to_thread(cache_root)) / f"go-{version}-{key}"
    if await asyncio.to_thread(final.is_dir):
        return SharedCache(final, GO_CACHE_PATH, "GOCACHE")
    work = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix=".go-", dir=final.parent))
    try:
        await asyncio.to_thread(_write_warmup, work)
        await _run(
            [go, "test", "-run", "NONE", "warm_test.go"],
            {**env, "GOCACHE": str(work / "cache")},
            work / "src",
        )
        await asyncio.to_thread(_publish, work / "cache", final)
    finally:
        await asyncio.to_thread(shutil.rmtree, work, True)
    return SharedCache(final, GO_CACHE_PATH, "GOCACHE")


async def _run(argv: list[str], env: dict[str, str], cwd: Path | None) -> str:
    proc = await asyncio.create_subprocess_exec(*argv, env=env, cwd=cwd, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)  # fmt: skip
    try:
        out, _ = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    if proc.returncode != 0:
        raise OSError(f"{' '.join(argv[:3])} failed: {out.decode(errors='replace')[-500:]}")
    return out.decode()


def _write_warmup(work: Path) -> None:
    (work / "src").mkdir()
    (work / "src" / "warm_test.go").write_text(GO_WARMUP)


def _publish(built: Path, final: Path) -> None:
    os.chmod(built, 0o755)
    with contextlib.suppress(OSError):  # another service renamed its build into place first
        os.rename(built, final)
