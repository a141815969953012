"""Control plane of the Arc Pro B70 DSpark appliance."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("b70ctl")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+source"
