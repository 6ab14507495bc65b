# posttrain: `make demo` runs the main job on the embedded default, `make test` passes the suite.
# Override the torch build with e.g. `make demo TORCH_SPEC="torch==2.6.0+cu124 --index-url ..."`
# or `TORCH_SPEC=skip` to keep the torch already in the environment.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
CORE := $(VENV)/.posttrain-core
STAMP := $(VENV)/.posttrain-installed
SANDBOX := $(VENV)/.posttrain-bubblewrap
SYSDEPS := $(VENV)/.posttrain-sysdeps

.PHONY: setup demo-setup demo test test-all bench clean sysdeps

# What the tests use: every optional extra, bubblewrap and chromium.
setup: $(STAMP) $(SYSDEPS)

# What the demo runs on: torch, posttrain and its core dependencies, bubblewrap (no test, cluster, serving or
# other ecosystems' extras, no chromium: ~30 s and a large apt package fewer on a fresh machine).
demo-setup: $(CORE) $(SANDBOX)

$(CORE): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	if [ "$(TORCH_SPEC)" != "skip" ]; then $(PIP) install -q $(TORCH_SPEC); fi
	$(PIP) install -q -e .
	touch $@

$(STAMP): $(CORE)
	$(PIP) install -q -e '.[dev]'
	touch $@

# bubblewrap (the sandbox) and chromium (the report test): installed where missing and we are root,
# otherwise scripts/sysdeps.sh says what to install.
$(SANDBOX): scripts/sysdeps.sh
	sh scripts/sysdeps.sh bubblewrap
	@mkdir -p $(VENV) && touch $@

$(SYSDEPS): scripts/sysdeps.sh
	sh scripts/sysdeps.sh bubblewrap chromium
	@mkdir -p $(VENV) && touch $@

demo: demo-setup
	$(VENV)/bin/posttrain demo

test: setup
	$(PY) -m pytest -q -x

test-all: setup
	$(PY) -m pytest -q -m '' 

# The benchmarks compare against TRL where it is installed (the `bench` extra).
bench: setup
	$(PIP) install -q -e '.[bench]'
	for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) runs .bench
