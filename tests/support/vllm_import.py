"""Importing the installed vLLM in a pytest worker that may have imported Ansible first.

Ansible's module_utils, once any test of the worker has imported them (the role's plugins and modules are tested
in-process), replace sys.intern with a callable object (ansible.module_utils._internal._patches.SysInternPatch), and
torch's dynamo, which `import vllm` pulls in, refuses to register its polyfill for anything but a function:
"substitute_in_graph expects a function". Which worker ran what first must not decide a test, so the patch is set
aside while vLLM is imported and put back after it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def builtin_sys_intern() -> Iterator[None]:
    current = sys.intern
    sys.intern = getattr(current, "unpatched_implementation", current)
    try:
        yield
    finally:
        sys.intern = current
