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


class B70Error(Exception):
    """An error that ends a command with one line naming the problem and the fix, and exit_code.

    Defined here, not in b70ctl, because host code refuses too (topology's refusals): b70ctl.errors re-exports the
    hierarchy, so one exception means "one line, this exit code" on both sides. Catch a family to handle one kind
    of failure; b70ctl's entry point catches B70Error. Each family is a subclass:
    - BadInput: the user's input is wrong (a flag, a file, a document, a name);
    - Unreachable: an endpoint, a registry, an API or a host could not be reached;
    - Refused: the input is well formed and the domain refuses it (a topology, a file that fails its hash);
    - HostFailed: a command on a host ran and failed;
    - CheckAborted: a check stopped before its end (a signal, its deadline)."""

    exit_code = 2


class BadInput(B70Error):
    """The user's input is wrong: exit 2 with one line naming the problem and the fix."""


class Unreachable(B70Error):
    """An endpoint, a registry, an API or a host could not be reached: exit 2, naming what and how to check it."""


class Refused(B70Error):
    """Well-formed input the domain refuses (a topology it cannot serve, a file that fails its hash): exit 2."""


class HostFailed(B70Error):
    """A command on a host ran and failed: exit 2 with its last line."""


class CheckAborted(B70Error):
    """A check stopped before its end; what it measured so far is kept, marked partial."""
