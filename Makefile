# The two commands of the README (make up, make test) set up ./.venv on first use.
.PHONY: up test test-unit test-more test-fuzz lint setup setup-test

# the whole disaggregated cluster (bare `pdserve up` picks one colocated worker on <= 2 cores)
up: setup
	.venv/bin/pdserve up --prefill 1 --decode 1

test: setup-test lint
	.venv/bin/python -m pytest -q -m "not slow and not fuzz and not browser"

test-unit: setup-test
	.venv/bin/python -m pytest -q -m unit

# (here 1,000 + 500 fuzz requests and 75 schemathesis cases per operation and mode, to keep
# .ci/run under 30 minutes on 2 cores; make test-fuzz runs 3,000 + 1,500 and 400)
test-more: setup-test
	PDSERVE_FUZZ_REQUESTS=1000 PDSERVE_SCHEMATHESIS_EXAMPLES=75 \
	    .venv/bin/python -m pytest -q -m "browser or fuzz"

test-fuzz: setup-test
	.venv/bin/python -m pytest -q -m fuzz -s tests/fuzz

lint: setup-test
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy

setup:
	@scripts/setup.sh

setup-test:
	@scripts/setup.sh --test
