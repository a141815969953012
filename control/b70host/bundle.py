#!/usr/bin/env python3
"""Everything `b70ctl host environment` maps onto a report's environment, collected on the serving host in one run.

Standard library only (run by the replication_check role through b70_host_python). One JSON object, the
HostBundle document b70ctl validates (b70ctl.host.environment):
  hostname         --hostname (the inventory's name for the host)
  facts            the GPU inventory under --root (facts.collect_facts: what the b70 Ansible fact prints)
  topology, image, models, serve
                   /etc/b70/topology.json, image.json, models.json, serve.json as the stages wrote them ({} when a
                   stage has not run yet)
  compute_runtime  the installed version of Intel's Level Zero GPU driver (libze-intel-gpu1), or null

    python3 -m b70host.bundle --hostname NAME [--root /] [--etc-dir /etc/b70] [--require DOCUMENT ...]

Exit 2 with one line when a document is there but is not a JSON object (its stage wrote something else: run it
again), so a report never describes a host from a broken file, and when a document --require names is missing
(the serve stage needs the image and models stages' documents: it names the stage to run first).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from b70host import B70Error, BadInput
from b70host.facts import collect_facts

DOCUMENTS = (("topology", "topology.json", "playbooks/host.yml"), ("image", "image.json", "playbooks/image.yml"),
             ("models", "models.json", "playbooks/models.yml"), ("serve", "serve.json", "playbooks/serve.yml"))
# The compute runtime's GPU driver package (intel/compute-runtime's Level Zero driver).
RUNTIME_PACKAGE = "libze-intel-gpu1"


def read_document(path: str, stage: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            document = json.load(handle)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        raise BadInput("%s cannot be read as JSON (%s): run %s again" % (path, error, stage)) from error
    if not isinstance(document, dict):
        raise BadInput("%s is not a JSON object: run %s again" % (path, stage))
    return document


def compute_runtime(runner: Any = subprocess.run) -> str | None:
    try:
        done = runner(["dpkg-query", "--show", "--showformat=${Version}", RUNTIME_PACKAGE], capture_output=True,
                      text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:  # not installed (a CPU host), or no dpkg
        return None
    return done.stdout.strip() or None


def bundle(hostname: str, root: str = "/", etc_dir: str = "/etc/b70", require: Sequence[str] = ()) -> dict[str, Any]:
    collected: dict[str, Any] = {"hostname": hostname, "facts": collect_facts(root),
                                 "compute_runtime": compute_runtime()}
    for key, name, stage in DOCUMENTS:
        path = os.path.join(etc_dir, name)
        collected[key] = read_document(path, stage)
        if key in require and not collected[key]:
            raise BadInput("%s is missing: run %s first" % (path, stage))
    return collected


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print what b70ctl host environment reads of this host, as JSON.")
    parser.add_argument("--hostname", required=True, help="the inventory's name for this host")
    parser.add_argument("--root", default="/", help="root prefix of the sysfs/procfs tree to read (default /)")
    parser.add_argument("--etc-dir", default="/etc/b70", help="the appliance's document directory")
    parser.add_argument("--require", action="append", default=[], choices=[key for key, _, _ in DOCUMENTS],
                        help="a document that must be there (repeatable): missing, exit 2 naming its stage")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.root):
        sys.stderr.write("error: --root %s is not a directory: give the root of a sysfs tree\n" % args.root)
        return 2
    try:
        collected = bundle(args.hostname, args.root, args.etc_dir, args.require)
    except B70Error as refused:
        sys.stderr.write("error: %s\n" % refused)
        return 2
    for warning in collected["facts"].get("warnings", []):
        sys.stderr.write("warning: %s\n" % warning)  # stdout stays the JSON b70ctl reads
    sys.stdout.write(json.dumps(collected, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
