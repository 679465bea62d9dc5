# The two commands of the README: `make demo` and `make test`.
.PHONY: setup demo test bench clean

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/python examples/fanout_demo.py

test: setup
	.venv/bin/python -m pytest -q

bench: setup
	bash scripts/setup.sh --bench
	.venv/bin/python bench/lifecycle.py --json
	.venv/bin/python bench/api.py --json
	.venv/bin/python bench/fork.py --json

clean:
	rm -rf .venv build *.egg-info
