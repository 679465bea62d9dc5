# The two commands of the README: `make demo` and `make test`.
.PHONY: setup demo test bench clean

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/python examples/rl_demo.py

test: setup
	.venv/bin/python -m pytest -q

bench:
	bash scripts/setup.sh --bench  # everything `setup` does, plus the peers (bubblewrap, podman)
	.venv/bin/python bench/lifecycle.py --json
	.venv/bin/python bench/scale.py --json
	.venv/bin/python bench/api.py --json
	.venv/bin/python bench/fork.py --json
	.venv/bin/python bench/burst.py --json
	.venv/bin/python bench/density.py --json
	.venv/bin/python bench/soak.py --json
	.venv/bin/python bench/pipeline.py --json
	.venv/bin/python bench/cli.py --json
	.venv/bin/python bench/images.py --json
	.venv/bin/python bench/tiers.py --json
	.venv/bin/python bench/network.py --json
	.venv/bin/python bench/integrations.py --json
	.venv/bin/python bench/cluster.py --json
	.venv/bin/python bench/groups.py --json
	.venv/bin/python bench/gpu.py --json  # says "skipped" on a host without a GPU

clean:
	rm -rf .venv build *.egg-info
