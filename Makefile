# splitspec — everything installs into .venv from the project's own files.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Extra pytest arguments, e.g. `make test PYTEST_ARGS="-k service"`.
PYTEST_ARGS ?=

.PHONY: setup test test-slow test-all demo proto bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: this exact version resolves to the CPU build that lies on disk here
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev,server,netsim,bench,daemon]"
	# the chat page's browser test drives Debian's chromium + chromedriver; where apt-get may not
	# run (not root, no Debian), tests/test_chat_page.py is skipped and says why
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
	  (DEBIAN_FRONTEND=noninteractive timeout 300 apt-get update -q >/dev/null 2>&1 && \
	   DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -q chromium chromium-driver >/dev/null 2>&1) || \
	  echo "chromium not installed: the chat page's browser test will be skipped"
	touch $(STAMP)

setup: $(STAMP)

# The default tier: everything but the tests marked slow (training runs, SmolLM2, server child
# processes) or netsim (tens of seconds of emulated links each). `make test-slow` runs those,
# `make test-all` both; .ci/run runs `make test`, then the slow tier in the time that is left.
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not netsim" $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m "slow or netsim" $(PYTEST_ARGS)

test-all: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/splitspec pull smollm2-135m
	$(BIN)/splitspec demo

proto: $(STAMP)
	$(BIN)/python proto/generate.py

bench: $(STAMP)
	$(BIN)/splitspec bench --profiles lan,5g,4g --categories writing,math_reasoning,summarization,humaneval \
		--max-new-tokens 48 --out out/bench --overwrite

clean:
	rm -rf $(VENV) build *.egg-info out .pytest_cache
