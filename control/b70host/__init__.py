"""The appliance's code that runs on the serving hosts: standard library only, so a host needs nothing but python3.

One directory on a host, {b70_lib_dir}/b70host (roles/b70/tasks/host_package.yml copies it there), and each module
run as `python3 -B -P -m b70host.<module>` with that directory's parent as PYTHONPATH (the b70 role's
b70_host_python):
- facts: the GPU inventory under a root prefix (the b70 Ansible fact; preflight also pipes this one file to a host
  it has not changed yet, so it imports nothing of its siblings).
- topology, level_zero: PCIe P2P per GPU pair and the oneCCL profile; the Level Zero probe.
- serve_wait, journal: the serve gate's wait for /health, stopping at the first death; the units' last journal
  lines when a start failed (b70ctl diagnose --start reads them).
- roofline_inputs: what the decode roofline needs that only the serving host can tell.
- bundle: what `b70ctl host environment` maps onto a report (the GPU inventory, the stages' documents, the
  compute runtime's version), in one run.

b70ctl on the controller imports the same modules (`b70ctl host facts`, `host topology`, verify's roofline), so
the controller and the host print the same documents.
"""

from __future__ import annotations


class BadInput(Exception):
    """Bad input or unreachable service: exit 2 with one line naming the problem and the fix.

    Defined here, not in b70ctl, because host code refuses too (topology's refusals): b70ctl.errors re-exports this
    class, so one exception means "one line, exit 2" on both sides."""

    exit_code = 2
