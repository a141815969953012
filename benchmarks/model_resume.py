#!/usr/bin/env python3
"""One large model file sent to a real test host by the model_store role's steps: a first send, a no-op re-run,
a transfer cut part-way (Ctrl-C) and its resume, a file with a few wrong bytes whose manifest is gone (as after
a cut), and the ansible.builtin.copy the role used before, for comparison.

The playbook runs the role's three install steps on one directory as roles/model_store/tasks/fetched.yml does
(b70_model_dir plans, b70_model_send sends what the plan lists, b70_model_dir verifies and records), with the
role's module and action plugin and the repository's ansible.cfg, over SSH to one systemd test host
(scripts/testhosts; prefix b70-resume). The file is random bytes made on the controller. Prints one table: wall
seconds, what the host kept and what was sent. The load average (1 min) is printed beside each run: the machine's
other work moves the times. Tears the host down unless --keep. Needs root.

    .venv/bin/python benchmarks/model_resume.py [--gib 2.5] [--cut-at 0.6] [--keep]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests" / "appliance"))

from provision import ANSIBLE_PLAYBOOK, HostUnderTest, run_testhosts, write_inventory  # noqa: E402

PREFIX = "b70-resume"
SUBNET = "172.30.84.0/24"
HOST_DIR = "/var/lib/b70/models/resume-bench/target"
SHARD = "model-00001-of-00001.safetensors"

INSTALL = """
- hosts: all
  gather_facts: false
  become: true
  vars:
    files: "{{ lookup('file', manifest_file) | from_json }}"
  tasks:
    - name: Compare the host's directory with its manifest
      b70_model_dir: {path: "{{ host_dir }}", files: "{{ files }}"}
      register: planned
    - name: Send the files the host lacks
      b70_model_send:
        src: "{{ cache_dir }}"
        path: "{{ host_dir }}"
        file: "{{ files | selectattr('path', 'equalto', item) | first }}"
      loop: "{{ planned.send }}"
      register: sent
    - name: Verify the host's files, then record the manifest
      b70_model_dir:
        path: "{{ host_dir }}"
        files: "{{ files }}"
        state: verified
        verified: >-
          {{ planned.verified + (sent.results | selectattr('placed', 'defined') | map(attribute='path') | list) }}
      register: recorded
      when: not planned.in_place
    - name: Write the figures
      ansible.builtin.copy:
        content: "{{ {'plan_hashed_bytes': planned.hashed_bytes,
                      'kept_bytes': sent.results | default([]) | map(attribute='kept_bytes') | sum,
                      'sent_bytes': sent.results | default([]) | map(attribute='sent_bytes') | sum,
                      'record_hashed_bytes': recorded.hashed_bytes | default(0)} | to_json }}"
        dest: "{{ figures_file }}"
        mode: "0644"
      delegate_to: localhost
      become: false
"""

COPY = """
- hosts: all
  gather_facts: false
  become: true
  tasks:
    - name: Make the directory
      ansible.builtin.file: {path: "{{ host_dir }}-copy", state: directory, mode: "0755"}
    - name: Copy as the role did before
      ansible.builtin.copy: {src: "{{ cache_dir }}/{{ shard }}", dest: "{{ host_dir }}-copy/{{ shard }}", mode: "0644"}
"""


def write_shard(path: Path, size_bytes: int) -> str:
    digest = hashlib.sha256()
    with open(path, "wb") as out:
        left = size_bytes
        while left:
            block = os.urandom(min(left, 16 << 20))
            digest.update(block)
            out.write(block)
            left -= len(block)
    return digest.hexdigest()


def on_host(host: str, command: str) -> str:
    return subprocess.run(["docker", "exec", host, "sh", "-c", command], check=True, capture_output=True,
                          text=True).stdout.strip()


def partial_bytes(host: str) -> int:
    return int(on_host(host, f"stat -c %s {HOST_DIR}/{SHARD}.partial 2>/dev/null || echo 0"))


def playbook_run(work: Path, playbook: str, extra: dict, cut_at_bytes: int | None = None,
                 host: str = "") -> tuple[float, float, int]:
    """(wall seconds, load average at the start, exit code); with cut_at_bytes, Ctrl-C once the host's partial
    holds that much."""
    book = work / "playbook.yml"
    book.write_text(playbook)
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO_ROOT / "ansible.cfg"),
           "ANSIBLE_ACTION_PLUGINS": str(REPO_ROOT / "roles" / "model_store" / "action_plugins"),
           "ANSIBLE_LIBRARY": str(REPO_ROOT / "roles" / "model_store" / "library")}
    argv = [str(ANSIBLE_PLAYBOOK), "-i", str(work / "inventory.yml"), str(book), "-e", json.dumps(extra)]
    load_1min = os.getloadavg()[0]
    started = time.monotonic()
    with open(work / "ansible.log", "ab") as log:
        process = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        if cut_at_bytes is not None:
            while process.poll() is None and partial_bytes(host) < cut_at_bytes:
                time.sleep(1)
            process.send_signal(signal.SIGINT)
        code = process.wait()
    return time.monotonic() - started, load_1min, code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.5, help="size of the file sent")
    parser.add_argument("--cut-at", type=float, default=0.6, help="fraction of the file on the host at the cut")
    parser.add_argument("--keep", action="store_true", help="leave the host running afterwards")
    args = parser.parse_args()
    size_bytes = int(args.gib * (1 << 30))
    rows: list[tuple[str, float, float, str, str, str, str]] = []
    with tempfile.TemporaryDirectory(prefix="b70-resume-") as work_name:
        work = Path(work_name)
        try:
            started = json.loads(run_testhosts("up", "--count", "1", "--prefix", PREFIX, "--subnet", SUBNET, "--fresh"))
            host = started["hosts"][0]
            write_inventory(work / "inventory.yml", [HostUnderTest(host["name"], host["address"], None)],
                            started["ssh_private_key"])
            cache = work / "cache"
            cache.mkdir()
            sha256 = write_shard(cache / SHARD, size_bytes)
            (work / "manifest.json").write_text(json.dumps([{"path": SHARD, "size_bytes": size_bytes,
                                                             "sha256": sha256}]))
            extra = {"cache_dir": str(cache), "host_dir": HOST_DIR, "manifest_file": str(work / "manifest.json"),
                     "figures_file": str(work / "figures.json"), "shard": SHARD}

            def install(label: str, cut_at_bytes: int | None = None) -> None:
                figures = work / "figures.json"
                figures.unlink(missing_ok=True)
                wall_s, load, code = playbook_run(work, INSTALL, extra, cut_at_bytes, host["name"])
                if cut_at_bytes is not None:
                    rows.append((label, wall_s, load, f"{partial_bytes(host['name']) / (1 << 20):,.0f} MiB (partial)",
                                 f"cut (exit {code})", "", ""))
                    return
                if code != 0:
                    raise SystemExit(f"{label}: exit {code}; see {work / 'ansible.log'}:\n"
                                     f"{(work / 'ansible.log').read_text()[-3000:]}")
                got = json.loads(figures.read_text())
                on_disk = on_host(host["name"], f"sha256sum {HOST_DIR}/{SHARD}").split()[0]
                assert on_disk == sha256, f"{label}: the host's file has sha256 {on_disk}"
                rows.append((label, wall_s, load, f"{got['kept_bytes'] / (1 << 20):,.0f} MiB",
                             f"{got['sent_bytes'] / (1 << 20):,.0f} MiB",
                             f"{got['plan_hashed_bytes'] / (1 << 20):,.0f} MiB",
                             f"{got['record_hashed_bytes'] / (1 << 20):,.0f} MiB"))

            wall_s, load, code = playbook_run(work, COPY, extra)
            rows.append(("ansible.builtin.copy, fresh (before)", wall_s, load, "", f"exit {code}", "", ""))
            install("b70_model_send, fresh")
            install("no-op re-run")
            on_host(host["name"], f"rm {HOST_DIR}/.b70-manifest.json {HOST_DIR}/{SHARD}")
            install(f"cut by Ctrl-C at {args.cut_at:.0%}", int(size_bytes * args.cut_at))
            install("resumed")
            on_host(host["name"], f"rm {HOST_DIR}/.b70-manifest.json && printf XXXX | dd of={HOST_DIR}/{SHARD} "
                                  f"bs=1 seek={size_bytes // 2} conv=notrunc status=none")
            install("4 wrong bytes, no manifest")
        finally:
            if not args.keep:
                run_testhosts("down", "--prefix", PREFIX)
    print(f"One {size_bytes / (1 << 30):.2f} GiB file (random bytes) to one test host over SSH; "
          f"{os.cpu_count()} cores; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    print("| run | wall s | load (1 min) | kept on the host | sent | host read by the plan | host read by the record |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row[0]} | {row[1]:.1f} | {row[2]:.1f} | " + " | ".join(row[3:]) + " |")


if __name__ == "__main__":
    main()
