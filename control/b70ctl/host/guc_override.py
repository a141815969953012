"""The good GuC blob of a release whose own firmware package carries a refused one (releases.yaml guc_override),
taken out of the .deb the matrix names, by content.

The .deb goes through the controller's content-addressed cache like every locked package (lock/debcache.py:
resumable, checked against its sha256 before it is kept); the blob is read out of its data archive with
python-debian, checked against the matrix's sha256 and size and against the GuC its own CSS header states (the
reader facts.py runs on hosts), and kept in the same cache under its own sha256, which is what host_kernel copies
to /lib/firmware/updates.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from b70ctl.documents import Pinned
from b70ctl.errors import BadInput
from b70ctl.host.releases import GucOverride


class CachedOverride(Pinned):
    file: str
    host_path: str
    cache_path: str
    sha256: str
    guc: str
    downloaded: bool


def cached_guc_override(override: GucOverride, cache: Path) -> CachedOverride:
    from debian.debfile import DebError, DebFile

    from b70ctl.lock.debcache import fetch_pin
    from b70host.facts import parse_css_release_version

    blob_path = cache / "sha256" / override.sha256  # the blob, by its own content, beside the .debs

    def done(downloaded: bool) -> CachedOverride:
        return CachedOverride(file=override.file, host_path=override.host_path, cache_path=str(blob_path),
                              sha256=override.sha256, guc=override.guc, downloaded=downloaded)

    if blob_path.is_file() and hashlib.sha256(blob_path.read_bytes()).hexdigest() == override.sha256:
        return done(False)
    deb, downloaded = fetch_pin(override.deb, cache)
    try:
        blob = DebFile(str(deb)).data.get_content(override.deb.member)
    except (DebError, KeyError, OSError) as error:
        raise BadInput(f"{override.deb.filename}: cannot read {override.deb.member} from it ({error}): fix the "
                       "release matrix's guc_override.deb.member (dpkg-deb -c lists the package)") from None
    if blob is None:
        raise BadInput(f"{override.deb.filename} has no {override.deb.member}: fix the release matrix's "
                       "guc_override.deb.member (dpkg-deb -c lists the package)")
    actual = hashlib.sha256(blob).hexdigest()
    release = parse_css_release_version(blob)
    if actual != override.sha256 or len(blob) != override.size_bytes or release != override.guc:
        raise BadInput(f"{override.deb.member} of {override.deb.filename} is sha256 {actual}, {len(blob)} bytes, "
                       f"GuC {release or 'unreadable'}; the release matrix says {override.sha256}, "
                       f"{override.size_bytes} bytes, GuC {override.guc}: nothing was cached (correct the matrix "
                       "from the package, or name another)")
    blob_path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=blob_path.parent, prefix=f".{blob_path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(blob)
        os.replace(temporary, blob_path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return done(downloaded)
