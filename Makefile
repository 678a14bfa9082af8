# weight-bridge: `make demo` runs the main job, `make test` runs the checks. Both set up .venv first.
VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.weight-bridge-installed
ARGS  ?=

.PHONY: setup demo test lint unit engine bench soak clean

$(STAMP): pyproject.toml scripts/setup_env.sh
	bash scripts/setup_env.sh
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(PY) -m apps.cli demo $(ARGS)

lint: setup
	$(VENV)/bin/ruff check bridge trainer_side inference_side devtools apps bench examples tests
	$(VENV)/bin/mypy bridge trainer_side inference_side devtools apps bench
	$(VENV)/bin/hadolint docker/*.Dockerfile

test: lint
	bash scripts/setup_system.sh
	$(PY) -m pytest -q -p no:cacheprovider $(ARGS)

unit: setup
	$(PY) -m pytest -q -m "not engine" $(ARGS)

bench: setup
	$(PY) -m bench.run $(ARGS)

soak: setup
	$(PY) -m pytest -q -m soak tests/test_soak.py --soak-full $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache artifacts
