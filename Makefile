# Two entry points: `make demo` and `make test`. Both work on a fresh machine with
# Python 3.11 and the package registries only.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip -q --disable-pip-version-check

.PHONY: demo test lint typecheck bench servers clean

$(PY):
	$(PYTHON) -m venv $(VENV)

demo: $(PY)
	$(PIP) install -e '.[cli]'
	$(VENV)/bin/fenced demo

# Debian packages for the real servers the tests start, strace for the fsync counts and
# Chromium for the pictures' and the dashboard's rendering checks, Node and curl for the
# non-Python clients of `fenced serve` (only when root; otherwise they must already be
# installed). PostgreSQL is looked for under /usr/lib/postgresql.
servers:
	@if [ "$$(id -u)" = 0 ]; then \
	  missing=""; \
	  command -v etcd >/dev/null || missing="$$missing etcd-server etcd-client"; \
	  command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	  [ -f /usr/share/java/zookeeper.jar ] || missing="$$missing zookeeper"; \
	  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing="$$missing postgresql"; \
	  command -v java >/dev/null || missing="$$missing default-jre-headless"; \
	  command -v strace >/dev/null || missing="$$missing strace"; \
	  command -v chromium >/dev/null || missing="$$missing chromium"; \
	  command -v node >/dev/null || missing="$$missing nodejs"; \
	  command -v curl >/dev/null || missing="$$missing curl"; \
	  command -v faketime >/dev/null || missing="$$missing faketime"; \
	  PATH="$$PATH:/usr/sbin" command -v mariadbd >/dev/null || missing="$$missing mariadb-server"; \
	  if [ -n "$$missing" ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  fi; \
	fi

test: $(PY) servers
	$(PIP) install -e '.[dev]'
	$(VENV)/bin/ruff check src tests bench docs/img examples
	$(VENV)/bin/ruff format --check src tests bench docs/img examples
	$(VENV)/bin/mypy
	$(PY) -m pytest -n 2 --dist loadgroup -q

lint:
	$(VENV)/bin/ruff check src tests bench docs/img
	$(VENV)/bin/ruff format src tests bench docs/img

bench: $(PY)
	$(PIP) install -e '.[all]'
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
