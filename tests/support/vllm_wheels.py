"""Released vLLM wheels, read as the truth a test holds the code to (their source files, never installed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from b70ctl.verify.embedded import default_cache_dir


def wheel(requirement: str) -> Path:
    """The wheel of REQUIREMENT (name==version), downloaded once into the user's cache."""
    name, version = requirement.split("==")
    cache = default_cache_dir() / "vllm-wheels"
    cache.mkdir(parents=True, exist_ok=True)
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    if not list(cache.glob(pattern)):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(cache),
                        requirement], check=True, timeout=900)
    found = sorted(cache.glob(pattern))
    assert found, f"pip downloaded no wheel named {pattern}"
    return found[0]
