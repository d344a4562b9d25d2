# The two commands of the README. Both set up ./.venv on first use.
.PHONY: up test test-unit test-fuzz setup setup-test

up: setup
	.venv/bin/pdserve up

test: setup-test
	.venv/bin/python -m pytest -q -m "not slow and not fuzz"

test-unit: setup-test
	.venv/bin/python -m pytest -q -m unit

test-fuzz: setup-test
	.venv/bin/python -m pytest -q -m fuzz -s tests/fuzz

setup:
	@scripts/setup.sh

setup-test:
	@scripts/setup.sh --test
