"""The languages /run_code runs, with SandboxFusion's semantics, and which of them this host can run.

Each language is a source file name, an optional compile step and a run step, as SandboxFusion
defines them, so a dataset's time limits and expected outputs mean the same here:

| language   | compile (compile_timeout)          | run (run_timeout)                              |
| ---------- | ---------------------------------- | ---------------------------------------------- |
| python     | -                                  | python _libra_main.py                          |
| bash       | -                                  | bash _libra_main.sh                            |
| pytest     | -                                  | python -m pytest test_main.py                  |
| cpp        | g++ -std=c++17 main.cpp -o main    | ./main                                         |
| rust       | rustc main.rs -o main              | ./main                                         |
| go         | go build -o main main.go           | ./main                                         |
| go_test    | -                                  | go test -exec CAP main_test.go (CAP: the output limit) |
| java       | javac -cp .:JARS Main.java         | java -cp .:JARS -ea Main                       |
| junit      | javac -cp .:JUNIT:JARS *.java      | java -jar JUNIT --class-path ... --scan-class-path |
| nodejs     | -                                  | node main.js                                   |
| typescript | -                                  | esbuild main.ts, then node (as tsx: no type check) |

(SandboxFusion links C++ with -lpthread, -lcrypto and -lssl when they are there; so does this.
JARS are the `.jar` files a request sends. Go runs in GOPATH mode against Debian's Go packages,
so `go_test` has testify as SandboxFusion's does. The JVM is told the sandbox's memory limit with
-XX:MaxRAM, as a JVM in a container with that limit would see it.)

Where memory is only an address-space rlimit (no memory cgroup), runtimes that reserve address
space up front cannot start at ordinary limits: at 512 MB the Go runtime (go, go_test, esbuild and
every Go binary) fails to reserve its page summary (it needs about 700 MB), V8 its code range
(about 750 MB), and the JVM its 1 GB class space. Those languages get `RESERVE_MB` of address space
beyond the request's limit (the JVM also smaller reservations), so there their bound is looser by
that much; the JVM's heap still follows the limit (-XX:MaxRAM).

At start the service looks for each language's programs on the sandbox's PATH (`detect`), reports
what it found, and answers a request for a language it could not find with SandboxFusion's shape
for an error of the sandbox (`SandboxError`, naming what is missing and the Debian package), so a
reward function scores a missing toolchain as the service's fault, never as the program's.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# Every language SandboxFusion knows: a request for one of these that this service does not run is
# the service's shortcoming (SandboxError), not a malformed request (422).
SANDBOXFUSION_LANGUAGES = (
    "python", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "typescript", "sql",
    "rust", "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest", "junit",
    "kotlin_script", "jest", "verilog", "python_gpu", "lean", "swift", "racket",
)  # fmt: skip
JUNIT_JAR = "/usr/share/java/junit-platform-console-standalone.jar"
GOPATH = "/usr/share/gocode"  # Debian's golang-*-dev packages
GO_ENV = (("GO111MODULE", "off"), ("GOPATH", GOPATH), ("GOCACHE", "/tmp/.go-build"), ("GOTOOLCHAIN", "local"))
# javac is a program of the service, not the user's: start it lean (the classes it writes are the same).
JAVAC_FLAGS = ("-J-XX:TieredStopAtLevel=1", "-J-XX:+UseSerialGC", "{javac_jvm}")
# Under an address-space limit (no memory cgroup): the JVM's smaller reservations, and the address
# space the Go, V8 and JVM runtimes get beyond the memory limit for what they reserve but never use.
JVM_FALLBACK_FLAGS = ("-XX:CompressedClassSpaceSize=64m", "-XX:ReservedCodeCacheSize=64m")
RESERVE_MB = 1024
# go test holds a test binary's whole output in memory before printing it (cmd/go buffers it, to
# cache and to scan it), so a test printing 1 GB was killed for memory instead of cut at the output
# limit. The binary runs through this wrapper (`go test -exec`), which passes the first N bytes and
# counts the rest, with the marker every other language's cut output ends with (sandbox.py).
GO_TEST_CAP = (
    """bash -c '"$@" 2>&1 | { head -c {n}; k=$(wc -c); if [ "$k" -gt 0 ]; then """
    """printf "\\n[... truncated %s bytes of output ...]\\n" "$k"; fi; }; exit ${PIPESTATUS[0]}' libra-output-cap"""
)
TS_RUN = (
    'esbuild "$1" --bundle --platform=node --format=cjs --packages=external --sourcemap=inline '
    "--log-level=error --outfile=/tmp/.libra-main.js && exec node --enable-source-maps /tmp/.libra-main.js"
)


@dataclass(frozen=True, slots=True)
class Language:
    name: str
    source: str  # the file `code` is written to ("{class}" is the code's public class, for junit)
    run: tuple[str, ...]
    compile: tuple[str, ...] | None = None
    needs: tuple[str, ...] = ()  # programs on the sandbox's PATH, or absolute paths of files
    package: str = ""  # what provides them (Debian)
    env: tuple[tuple[str, str], ...] = ()
    cache: str | None = None  # a shared build cache it uses (caches.py)
    reserves_mb: int = 0  # address space its runtime reserves beyond what it uses (rlimit fallback only)


LANGUAGES = {
    lang.name: lang
    for lang in (
        Language("python", "_libra_main.py", ("{python}", "{src}")),
        Language("bash", "_libra_main.sh", ("bash", "{src}"), needs=("bash",), package="bash"),
        Language("pytest", "test_main.py", ("{python}", "-m", "pytest", "{src}"), needs=("pytest",),
                 package="pytest in the sandbox's python (pip install pytest, or python3-pytest)"),
        Language("cpp", "main.cpp", ("./main",), ("g++", "-std=c++17", "{src}", "-o", "main", "{cxxlibs}"),
                 needs=("g++",), package="g++"),
        Language("rust", "main.rs", ("./main",), ("rustc", "{src}", "-o", "main"), needs=("rustc", "cc"),
                 package="rustc"),
        Language("go", "main.go", ("./main",), ("go", "build", "-o", "main", "{src}"), needs=("go",),
                 package="golang-go", env=GO_ENV, cache="go", reserves_mb=RESERVE_MB),
        Language("go_test", "main_test.go", ("go", "test", "{go_exec}", "{src}"), needs=("go", "bash"),
                 package="golang-go (and golang-github-stretchr-testify-dev for testify)", env=GO_ENV,
                 cache="go", reserves_mb=RESERVE_MB),
        Language("java", "Main.java", ("java", "{jvm}", "-cp", "{classpath}", "-ea", "Main"),
                 ("javac", *JAVAC_FLAGS, "-cp", "{classpath}", "{src}"), needs=("javac", "java"),
                 package="default-jdk-headless", reserves_mb=RESERVE_MB),
        Language("junit", "{class}.java",
                 ("java", "{jvm}", "-jar", JUNIT_JAR, "--class-path", "{classpath}", "--scan-class-path"),
                 ("javac", *JAVAC_FLAGS, "-cp", "{classpath}", "{java_files}"),
                 needs=("javac", "java", JUNIT_JAR), package="default-jdk-headless and junit5",
                 reserves_mb=RESERVE_MB),
        Language("nodejs", "main.js", ("node", "{src}"), needs=("node",), package="nodejs", reserves_mb=RESERVE_MB),
        Language("typescript", "main.ts", ("/bin/sh", "-c", TS_RUN, "typescript", "{src}"),
                 needs=("node", "esbuild"), package="nodejs and esbuild", reserves_mb=RESERVE_MB),
    )
}  # fmt: skip
PUBLIC_CLASS = re.compile(r"^\s*public\s+(?:(?:final|abstract|strictfp)\s+)*class\s+([A-Za-z_$][\w$]*)", re.M)


@dataclass(frozen=True, slots=True)
class Toolchains:
    """What `detect` found: the languages this service runs, why the others are missing, and the
    C++ libraries to link (SandboxFusion's optional -l flags that exist here)."""

    available: tuple[str, ...]
    missing: dict[str, str]
    cxxlibs: tuple[str, ...] = ()

    def missing_message(self, language: str) -> str:
        if language in self.missing:
            return f"language {language} is not available on this service: {self.missing[language]}"
        runs = ", ".join(self.available)
        return f"language {language} is not run by this service (it runs {runs})"


def detect(path: str, python: str) -> Toolchains:
    """Look for each language's programs as the sandbox would find them (its PATH)."""
    available, missing = [], {}
    for lang in LANGUAGES.values():
        absent = [n for n in lang.needs if not _present(n, path, python)]
        if absent:
            missing[lang.name] = f"{', '.join(absent)} not found (install {lang.package})"
        else:
            available.append(lang.name)
    cxx = tuple(
        f"-l{lib}" for lib in ("pthread", "crypto", "ssl") if "cpp" in available and _links(lib, path)
    )
    return Toolchains(tuple(available), missing, cxx)


def _present(need: str, path: str, python: str) -> bool:
    if need.startswith("/"):
        return Path(need).is_file()
    if need == "pytest":
        r = subprocess.run([python, "-c", "import pytest"], capture_output=True, timeout=60)
        return r.returncode == 0
    return shutil.which(need, path=path) is not None


def _links(lib: str, path: str) -> bool:
    """g++ prints an absolute path for a library it can link, the bare name for one it cannot."""
    gxx = shutil.which("g++", path=path)
    try:
        r = subprocess.run([gxx, f"-print-file-name=lib{lib}.so"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0 and r.stdout.strip().startswith("/")


def source_name(lang: Language, code: str) -> str:
    """The file the code goes to: junit's is named after the code's public class, as javac needs."""
    if "{class}" not in lang.source:
        return lang.source
    m = PUBLIC_CLASS.search(code)
    return lang.source.format(**{"class": m.group(1) if m else "Main"})


def inner_cap(output_bytes: int) -> int:
    """What a harness's wrapper passes: the output limit less room for the harness's own lines
    (go test's FAIL summary) and the marker, so the service's cap does not cut those off."""
    return max(output_bytes // 2, output_bytes - 4096)


def render(lang: Language, argv: tuple[str, ...], src: str, python: str, toolchains: Toolchains,
           memory_mb: int, file_names: list[str], address_space: bool, output_bytes: int) -> list[str]:  # fmt: skip
    """A step's argv with its placeholders filled in (`file_names`: every file of the request;
    `address_space`: memory is an rlimit on address space, not a cgroup; `output_bytes`: the
    output limit, applied inside harnesses that would otherwise hold a test's whole output)."""
    jars = [n for n in file_names if n.endswith(".jar") and not n.startswith("/")]
    java_files = sorted({src, *(n for n in file_names if n.endswith(".java") and not n.startswith("/"))})
    classpath = ":".join([".", *([JUNIT_JAR] if lang.name == "junit" else []), *jars])
    jvm = [f"-XX:MaxRAM={memory_mb * 2**20}", *(JVM_FALLBACK_FLAGS if address_space else ())]
    values = {"{src}": [src], "{python}": [python], "{cxxlibs}": list(toolchains.cxxlibs),
              "{java_files}": java_files, "{classpath}": [classpath], "{jvm}": jvm,
              "{javac_jvm}": [f"-J{f}" for f in jvm],
              "{go_exec}": ["-exec", GO_TEST_CAP.replace("{n}", str(inner_cap(output_bytes)))]}  # fmt: skip
    return [x for arg in argv for x in values.get(arg, [arg])]
