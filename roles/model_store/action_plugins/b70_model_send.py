"""Send one model file from the controller's cache to a host so that a cut transfer resumes where it stopped.

Why chunks over the play's own connection and not rsync --partial/--append-verify: ansible-core has no rsync
module (ansible.posix.synchronize is a separate collection, not installed here), the hosts' base system has no
rsync, and rsync would open its own SSH connection beside the play's, re-deriving user, key, port, become and
jump hosts (and could not reach a host over a docker or local connection at all). --append-verify also trusts the
partial's bytes until the very end and then sends the whole file again when they were wrong. Chunks sent through
the connection Ansible already has need nothing on the host beyond Python, and each chunk is checked on arrival.

The host keeps NAME.partial; the controller hashes its copy in chunks, the host answers which chunks of its
partial are missing or wrong (bytes past the file's size are cut off), only those are sent, a batch at a time,
and the partial is renamed into place only once its whole sha256 matches the lock. The chunking itself is
defined once, in the role's b70_model_dir module, which runs each host step.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from typing import Any

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase

# 64 MiB chunks: a cut transfer re-sends at most one chunk's worth of what reached the partial, and a 28 GB
# target's chunk hashes (~450) stay a small module argument. Chunks are staged in Ansible's temporary directory on
# the host and written by one module run per batch: a batch of 4 (256 MiB) is what a cut loses (and what an
# interrupted run leaves in that directory, as any interrupted copy does), for one module round trip per 256 MiB.
CHUNK_BYTES = 64 << 20
BATCH_BYTES = 4 * CHUNK_BYTES


def _model_dir_module() -> Any:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "library", "b70_model_dir.py")
    spec = importlib.util.spec_from_file_location("b70_model_dir_chunks", path)
    assert spec is not None and spec.loader is not None, path
    module: Any = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ActionModule(ActionBase):
    TRANSFERS_FILES = True
    _VALID_ARGS = frozenset(("src", "path", "file", "chunk_bytes", "batch_bytes"))

    def run(self, tmp: str | None = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        result: dict[str, Any] = super().run(tmp, task_vars)
        del tmp
        args = self._task.args
        try:
            entry = dict(args["file"])
            source = os.path.join(args["src"], entry["path"])
            directory = args["path"]
        except (KeyError, TypeError, ValueError) as error:
            raise AnsibleActionFail(f"src, path and file (path, size_bytes, sha256) are required: {error}") from error
        chunk_bytes = int(args.get("chunk_bytes", CHUNK_BYTES))
        batch_bytes = int(args.get("batch_bytes", BATCH_BYTES))
        if self._task.check_mode:
            result.update(changed=True, msg=f"would send {source} to {directory}")
            return result
        chunks = _model_dir_module()
        remote_tmp = self._connection._shell.tmpdir
        local_dir = tempfile.mkdtemp(prefix="b70-chunk-")
        local_chunk = os.path.join(local_dir, "chunk")

        def host(chunk_sha256: list[str], staged: dict[str, str], finish: bool) -> dict[str, Any]:
            answer: dict[str, Any] = self._execute_module(
                module_name="b70_model_dir", task_vars=task_vars,
                module_args={"path": directory, "state": "partial", "file": entry, "chunk_bytes": chunk_bytes,
                             "chunk_sha256": chunk_sha256, "staged": staged, "finish": finish})
            if answer.get("failed"):
                raise AnsibleActionFail(answer.get("msg", f"{directory}: the host step failed"), result=answer)
            return answer

        def stage(index: int, offset: int, length: int) -> str:
            with open(source, "rb") as handle:
                handle.seek(offset)
                data = handle.read(length)
            with open(local_chunk, "wb") as out:
                out.write(data)
            remote: str = self._connection._shell.join_path(remote_tmp, f"chunk-{index}")
            self._transfer_file(local_chunk, remote)
            self._fixup_perms2((remote_tmp, remote))
            return remote

        try:
            result.update(chunks.send_file(source, entry, chunk_bytes, batch_bytes, host, stage))
            # Placed: renamed into place by the host after its sha256 matched; the record step need not read it.
            result.update(placed=True, directory=directory, path=entry["path"])
        except (OSError, ValueError) as error:
            raise AnsibleActionFail(f"{directory}/{entry['path']}: {error}") from error
        finally:
            if os.path.exists(local_chunk):
                os.unlink(local_chunk)
            os.rmdir(local_dir)
            self._remove_tmp_path(remote_tmp)
        return result
