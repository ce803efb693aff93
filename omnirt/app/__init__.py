"""omnirt's API process: transports, protocols and sessions (never tensors)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("omnirt")
except PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0+unknown"
