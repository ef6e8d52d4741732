# splitspec — everything installs into .venv from the project's own files.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Extra pytest arguments, e.g. `make test PYTEST_ARGS="-k service"`.
PYTEST_ARGS ?=

.PHONY: setup test demo proto bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: this exact version resolves to the CPU build that lies on disk here
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev,server,netsim,bench,daemon]"
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/splitspec pull smollm2-135m
	$(BIN)/splitspec demo

proto: $(STAMP)
	$(BIN)/python proto/generate.py

bench: $(STAMP)
	$(BIN)/splitspec bench --profiles lan,5g,4g --categories writing,math_reasoning,summarization,humaneval \
		--max-new-tokens 48 --out out/bench

clean:
	rm -rf $(VENV) build *.egg-info out .pytest_cache
