# Two entry points: `make demo` and `make test`. Both work on a fresh machine with
# Python 3.11 and the package registries only.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip -q --disable-pip-version-check
# The test environment is installed from a pinned, hash-checked lock (requirements/dev.lock,
# made by `make lock` from pyproject.toml; tests/project/test_lock.py fails when the two disagree) with
# uv: resolving the 130 packages afresh took pip about 10 minutes on a new machine, uv installs
# the lock in under a minute. pip installs the same lock if uv cannot run.
UV_VERSION := 0.13.9
UV     := $(VENV)/bin/uv
LOCK   := requirements/dev.lock
PHASE  := PHASE_LOG=$(CURDIR)/.phase-times tools/phase

.PHONY: demo test test-long install-dev lint typecheck bench servers clean lock

$(PY):
	$(PYTHON) -m venv $(VENV)

demo: $(PY)
	$(PIP) install -e '.[cli]'
	$(VENV)/bin/fenced demo

# Debian packages for the real servers the tests start, fuse3 for the power-loss filesystem
# (tests/powerloss: fusermount3 and libfuse3, which mfusepy loads), strace for the fsync counts,
# Chromium for the pictures' and the dashboard's rendering checks, Node, the JDK (javac: the
# Java client is compiled by the tests) and curl for the non-Python clients of `fenced serve`,
# iproute2 for the partition harness's network namespaces (only when root; otherwise they must
# already be installed). PostgreSQL is looked for under /usr/lib/postgresql.
servers:
	@if [ "$$(id -u)" = 0 ]; then \
	  missing=""; \
	  command -v etcd >/dev/null || missing="$$missing etcd-server etcd-client"; \
	  command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	  [ -f /usr/share/java/zookeeper.jar ] || missing="$$missing zookeeper"; \
	  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing="$$missing postgresql"; \
	  command -v java >/dev/null || missing="$$missing default-jre-headless"; \
	  command -v javac >/dev/null || missing="$$missing default-jdk-headless"; \
	  command -v strace >/dev/null || missing="$$missing strace"; \
	  command -v chromium >/dev/null || missing="$$missing chromium"; \
	  command -v node >/dev/null || missing="$$missing nodejs"; \
	  command -v curl >/dev/null || missing="$$missing curl"; \
	  command -v faketime >/dev/null || missing="$$missing faketime"; \
	  command -v fusermount3 >/dev/null || missing="$$missing fuse3"; \
	  PATH="$$PATH:/usr/sbin" command -v mariadbd >/dev/null || missing="$$missing mariadb-server"; \
	  PATH="$$PATH:/usr/sbin:/sbin" command -v ip >/dev/null || missing="$$missing iproute2"; \
	  if [ -n "$$missing" ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  fi; \
	fi

$(UV): $(PY)
	$(PIP) install 'uv==$(UV_VERSION)'

# More xdist workers than cores: most of a test's time is spent waiting (ttls, server
# start-ups, paused processes), so with one worker a core CI's 2 cores were only half busy
# (2026-11-27: 979 s of wall for 991 s of CPU). On 2 cores, 4 workers took 501 s and 5 took
# 453 s for the same 764 s of CPU (84 % busy). The tests' walls, measured one by one, are ~3x
# their CPU: a model of the run (each test's CPU and waits, the cores shared; fitted to the
# 5-worker runs) puts 6 workers 30-50 s under 5 (docs/benchmarks.md, session 8). Each worker
# starts its own servers on first use (all six: ~3 s of CPU, ~0.3 GB of memory): at most 8.
TEST_WORKERS ?= $(shell n=$$(( 3 * $$(nproc 2>/dev/null || echo 1) )); echo $$(( n > 8 ? 8 : n )))

test: $(PY)
	@$(PHASE) --reset
	@$(PHASE) servers $(MAKE) --no-print-directory servers
	@$(PHASE) install $(MAKE) --no-print-directory install-dev
	@$(PHASE) lint sh -c '$(VENV)/bin/ruff check src tests bench docs/img examples && $(VENV)/bin/ruff format --check src tests bench docs/img examples'
	@$(PHASE) mypy $(VENV)/bin/mypy
	@$(PHASE) tests $(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup -q
	@$(PHASE) --summary

# The long randomized runs kept out of `make test` (docs/testing.md, "Long runs"); run after
# `make test` has installed the environment. The simulator's seeds, 10,000 by default (CI runs a
# bounded 2,000), from a random start unless FENCED_SIM_START is given (FENCED_SIM_SEEDS=1000000
# for a longer one); the schema, fuzz and signing property tests with many more examples; the
# replicated group's nemesis campaigns for 60 s each on three seeds.
FENCED_SIM_SEEDS ?= 10000
test-long: $(PY)
	@start=$${FENCED_SIM_START:-$$(od -An -N2 -tu2 /dev/urandom | tr -d ' ')}; \
	echo "FENCED_SIM_SEEDS=$(FENCED_SIM_SEEDS) FENCED_SIM_START=$$start"; \
	FENCED_SIM_SEEDS=$(FENCED_SIM_SEEDS) FENCED_SIM_START=$$start \
	  $(PY) -m pytest -n 2 --dist loadgroup -q tests/kit/test_sim.py tests/kit/test_sim_gateway.py
	FENCED_SCHEMA_EXAMPLES=100 FENCED_FUZZ_EXAMPLES=5000 FENCED_SIGNING_EXAMPLES=2000 \
	  $(PY) -m pytest -q tests/server/test_server_schema.py tests/server/test_server_fuzz.py \
	  tests/core/test_signing.py
	FENCED_GROUP_SECONDS=60 FENCED_GROUP_SEEDS=11,12,13 \
	  $(PY) -m pytest -q tests/replicated/test_group_faults.py -k under_the_nemesis

install-dev: $(PY)
	@if $(MAKE) --no-print-directory $(UV) && $(UV) pip install -q --python $(PY) --require-hashes -r $(LOCK); then \
	  $(UV) pip install -q --python $(PY) --no-deps -e .; \
	else \
	  echo "uv failed; installing the lock with pip"; \
	  $(PIP) install --no-deps --require-hashes -r $(LOCK) && $(PIP) install --no-deps -e .; \
	fi

# Re-pin the test environment after changing pyproject.toml's dependencies.
lock: $(UV)
	$(UV) pip compile pyproject.toml --extra dev --universal --python-version 3.11 \
	  --generate-hashes --no-header -q -o $(LOCK)

lint:
	$(VENV)/bin/ruff check src tests bench docs/img
	$(VENV)/bin/ruff format src tests bench docs/img

bench: $(PY)
	$(PIP) install -e '.[all]'
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) .phase-times build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
