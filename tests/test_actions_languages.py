"""Every language /run_code runs, through a real sandboxed service on loopback, in the request shape
verl's SandboxFusion client sends (`verl/utils/reward_score/sandbox_fusion/utils.py`: compile and run
timeouts, code, stdin, memory_limit_MB, language, empty files and fetch_files), with SandboxFusion's
answers: a correct program reading stdin, a compile error (in `compile_result` for compiled
languages, in `run_result` for the others, as SandboxFusion reports them), a runtime error, and a
timeout. The toolchains come from Debian packages (`make sysdeps`); a language whose toolchain is
missing here is skipped with the reason (a failure on CI, where `make sysdeps` installs them all), and
a missing toolchain's answer is tested on its own."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from libra.runtime.sandbox.client import ServiceProcess
from tests.test_actions_service import PATIENT_S, api, needs_sandbox, sandbox_available, unavailable

GO_TEST_OK = """package main
import (
    "testing"
    "github.com/stretchr/testify/assert"
)
func Double(x int) int { return 2 * x }
func TestDouble(t *testing.T) { assert.Equal(t, 42, Double(21)) }
"""
# JUnit's console launcher runs the classes its default filter matches (names ending in Test or
# Tests, or starting with Test), as in SandboxFusion.
JUNIT_OK = """import org.junit.jupiter.api.Test;
import static org.junit.jupiter.api.Assertions.*;
public class DoublerTest {
    static int twice(int x) { return 2 * x; }
    @Test void doubles() { assertEquals(42, twice(21)); }
}
"""
# pytest gives tests /dev/null as stdin (its fd capture), here as in SandboxFusion.
PYTEST_OK = "def double(x):\n    return 2 * x\n\ndef test_double():\n    assert double(21) == 42\n"

# language -> case -> code. `ok` reads 21 from stdin and prints 42 (test runners: passes).
CASES = {
    "cpp": {
        "ok": "#include <iostream>\nint main() { long long x; std::cin >> x; std::cout << 2 * x << std::endl; }",
        "compile_error": "int main() { return undefined_name; }",
        "runtime_error": '#include <stdexcept>\nint main() { throw std::runtime_error("boom"); }',
        "timeout": "int main() { volatile unsigned long x = 0; for (;;) x++; }",
    },
    "rust": {
        "ok": "use std::io::Read;\nfn main() { let mut s = String::new(); std::io::stdin().read_to_string(&mut s)"
        '.unwrap(); let x: i64 = s.trim().parse().unwrap(); println!("{}", 2 * x); }',
        "compile_error": 'fn main() { let x: i32 = "boom"; }',
        "runtime_error": 'fn main() { panic!("boom"); }',
        "timeout": 'fn main() { let mut x: u64 = 1; loop { x = x.wrapping_add(2); if x == 0 { println!("{}", x); } } }',
    },
    "go": {
        "ok": 'package main\nimport "fmt"\nfunc main() { var x int; fmt.Scan(&x); fmt.Println(2 * x) }',
        "compile_error": "package main\nfunc main() { x := 1 }",
        "runtime_error": 'package main\nfunc main() { panic("boom") }',
        "timeout": "package main\nfunc main() { for { } }",
    },
    "go_test": {  # go test does not give tests its stdin (nor does SandboxFusion's)
        "ok": GO_TEST_OK,
        "compile_error": 'package main\nimport "testing"\nfunc TestX(t *testing.T) { boom( }',
        "runtime_error": GO_TEST_OK.replace("42, Double(21)", "43, Double(21)").replace(
            "func Double", "func Double"
        ),
        "timeout": 'package main\nimport "testing"\nfunc TestSpin(t *testing.T) { for { } }',
    },
    "java": {
        "ok": "import java.util.*;\npublic class Main { public static void main(String[] a) { "
        "Scanner s = new Scanner(System.in); System.out.println(2 * s.nextLong()); } }",
        "compile_error": "public class Main { public static void main(String[] a) { int x = } }",
        "runtime_error": 'public class Main { public static void main(String[] a) { throw new RuntimeException("boom"); } }',
        "timeout": "public class Main { public static void main(String[] a) { long x = 0; while (true) x++; } }",
    },
    "junit": {
        "ok": JUNIT_OK,
        "compile_error": JUNIT_OK.replace("return 2 * x;", "return 2 * x"),
        "runtime_error": JUNIT_OK.replace("assertEquals(42", "assertEquals(43"),
        "timeout": JUNIT_OK.replace("assertEquals(42, twice(21));", "while (true) { }"),
    },
    "nodejs": {
        "ok": "const x = parseInt(require('fs').readFileSync(0, 'utf8')); console.log(2 * x);",
        "compile_error": "const x = ;",
        "runtime_error": "throw new Error('boom');",
        "timeout": "while (true) {}",
    },
    "typescript": {
        "ok": "import * as fs from 'fs';\nconst x: number = parseInt(fs.readFileSync(0, 'utf8'));\nconsole.log(2 * x);",
        "compile_error": "const x: number = ;",
        "runtime_error": "function f(): never { throw new Error('boom'); }\nf();",
        "timeout": "while (true) {}",
    },
    "pytest": {
        "ok": PYTEST_OK,
        "compile_error": "def test_x(:\n    pass\n",
        "runtime_error": "def test_boom():\n    assert 1 == 2, 'boom'\n",
        "timeout": "def test_spin():\n    while True:\n        pass\n",
    },
}
COMPILED = {"cpp", "rust", "go", "java", "junit"}


def verl_request(language: str, code: str, stdin: str | None, timeout: int) -> dict:
    """The body verl's `call_sandbox_api` posts (it uses one timeout for compile and run)."""
    return {"compile_timeout": timeout, "run_timeout": timeout, "code": code, "stdin": stdin,
            "memory_limit_MB": 1024, "language": language, "files": {}, "fetch_files": []}  # fmt: skip


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    unavailable(sandbox_available())
    cfg = tmp_path_factory.mktemp("languages") / "actions.yaml"
    cfg.write_text(json.dumps({"warm_pool": 1, "sandbox": {"uid_count": 64, "max_timeout_s": 300}}))
    with ServiceProcess(str(cfg)) as svc:
        yield svc


def post_all(url: str, bodies: dict[str, dict]) -> dict[str, dict]:
    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=PATIENT_S) as c:
            rs = await asyncio.gather(*[c.post("/run_code", json=b) for b in bodies.values()])
            return {k: r.json() for k, r in zip(bodies, rs, strict=True)}

    return asyncio.run(main())


@needs_sandbox
@pytest.mark.parametrize("language", sorted(CASES))
def test_language_speaks_sandboxfusion(service, language):
    health = api.get(f"{service.url}/health").json()
    if language not in health["languages"]:
        unavailable(f"{language}: {health['missing_languages'].get(language)}")
    cases = CASES[language]
    bodies = {
        "ok": verl_request(language, cases["ok"], "21", 120),
        "compile_error": verl_request(language, cases["compile_error"], None, 120),
        "runtime_error": verl_request(language, cases["runtime_error"], "", 120),
        # An endless loop is past any limit: the shortest one shows it (it burns a core till then).
        "timeout": verl_request(language, cases["timeout"], None, 120) | {"run_timeout": 1},
    }
    r = post_all(service.url, bodies)
    ok = r["ok"]
    assert ok["status"] == "Success", ok
    assert ok["run_result"]["status"] == "Finished" and ok["run_result"]["return_code"] == 0
    if language in ("go_test", "junit", "pytest"):
        assert ok["run_result"]["stdout"], ok  # the runner's report
    else:
        assert ok["run_result"]["stdout"] == "42\n", ok
    if language in COMPILED:
        assert ok["compile_result"]["status"] == "Finished" and ok["compile_result"]["return_code"] == 0
        bad = r["compile_error"]
        assert bad["status"] == "Failed" and bad["run_result"] is None, bad
        assert bad["compile_result"]["status"] == "Finished" and bad["compile_result"]["return_code"] != 0
        assert bad["compile_result"]["stderr"] + bad["compile_result"]["stdout"]  # the compiler's diagnostics
    else:
        assert ok["compile_result"] is None
        bad = r["compile_error"]
        assert bad["status"] == "Failed" and bad["compile_result"] is None, bad
        assert bad["run_result"]["status"] == "Finished" and bad["run_result"]["return_code"] != 0
    crash = r["runtime_error"]
    assert crash["status"] == "Failed", crash
    assert crash["run_result"]["status"] == "Finished" and crash["run_result"]["return_code"] not in (0, None)
    out = crash["run_result"]["stdout"] + crash["run_result"]["stderr"]
    assert ("boom" in out) or (language in ("go_test", "junit") and "FAIL" in out.upper()), crash
    slow = r["timeout"]
    assert slow["status"] == "Failed" and slow["run_result"]["status"] == "TimeLimitExceeded", slow
    assert slow["run_result"]["return_code"] is None
    assert api.get(f"{service.url}/health").json()["running"] == 0


@needs_sandbox
def test_typescript_runs_without_type_checking_as_tsx_does(service):
    """SandboxFusion runs TypeScript with tsx, which strips types without checking them."""
    r = api.post(f"{service.url}/run_code", json=verl_request(
        "typescript", "const x: number = 'not a number' as any;\nconsole.log(typeof x);", None, 60)).json()  # fmt: skip
    assert r["status"] == "Success" and r["run_result"]["stdout"] == "string\n", r


@needs_sandbox
def test_a_compile_timeout_is_reported_in_compile_result(service):
    # A constant evaluated at compile time that keeps g++ busy far longer than the compile timeout.
    code = ("constexpr long f() { long s = 0; for (long i = 0; i < 200000; i++) for (long j = 0; j < 200000; j++) "
            "s += i ^ j; return s; }\nconstexpr long v = f();\nint main() { return v > 0; }")  # fmt: skip
    body = verl_request("cpp", code, None, 60) | {"compile_timeout": 1}
    r = api.post(f"{service.url}/run_code", json=body).json()
    assert r["status"] == "Failed" and r["run_result"] is None, r
    assert r["compile_result"]["status"] == "TimeLimitExceeded" and r["compile_result"]["return_code"] is None


@needs_sandbox
def test_a_missing_toolchain_answers_sandbox_error(tmp_path):
    """A service whose sandbox python has no pytest cannot run `pytest`: it says so at start and in
    /health, and answers such a request with SandboxFusion's shape for an error of the sandbox, so
    verl scores it as the service's fault (-1), never as the program's. A language SandboxFusion
    knows but this service does not run is answered the same way; one SandboxFusion does not know
    is a 422 naming `language` and what is allowed."""
    cfg = tmp_path / "actions.yaml"
    # /usr/bin/python3 is Debian's own interpreter: without python3-pytest it has no pytest.
    cfg.write_text(json.dumps({"warm_pool": 0, "sandbox": {"uid_count": 64, "python": "/usr/bin/python3"}}))
    with ServiceProcess(str(cfg)) as svc:
        health = api.get(f"{svc.url}/health").json()
        if "pytest" in health["languages"]:
            pytest.skip("Debian's python3 has pytest here (python3-pytest is installed)")
        assert "pytest" in health["missing_languages"] and "missing languages" in "".join(svc.log)
        for language in ("pytest", "php"):
            r = api.post(f"{svc.url}/run_code", json=verl_request(language, "x", None, 10)).json()
            assert r["status"] == "SandboxError" and language in r["message"], r
            assert r["compile_result"] is None and r["run_result"] is None
        bad = api.post(f"{svc.url}/run_code", json=verl_request("cobol" * 1000, "x", None, 10))
        assert bad.status_code == 422 and len(bad.content) < 2000, bad.text[:300]
        detail = bad.json()["detail"][0]
        assert detail["field"] == "language" and "python" in detail["allowed"]
        ok = api.post(f"{svc.url}/run_code", json=verl_request("python", "print(6 * 7)", None, 10)).json()
        assert ok["run_result"]["stdout"] == "42\n"
