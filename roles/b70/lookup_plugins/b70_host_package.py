"""lookup('b70_host_package'): the directory of the host package (b70host) that the controller's b70ctl imports.

The roles copy that directory's modules to each host (roles/b70/tasks/host_package.yml) and the preflight pipes
its facts module to a host, so a host runs the same code as `b70ctl host facts` and `b70ctl host topology` on the
controller. The package is found by import, in the Python that runs ansible-playbook (b70ctl is installed beside
it), never by a path relative to the role.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ansible.errors import AnsibleError
from ansible.plugins.lookup import LookupBase


class LookupModule(LookupBase):
    def run(self, terms: list[Any], variables: dict[str, Any] | None = None, **kwargs: Any) -> list[str]:
        try:
            import b70host
        except ImportError as error:
            raise AnsibleError(f"the b70host package is not importable by this ansible-playbook ({error}): run it "
                               "from the environment b70ctl is installed in (`make venv`, then .venv/bin/"
                               "ansible-playbook)") from error
        return [str(Path(b70host.__file__).resolve().parent)]
