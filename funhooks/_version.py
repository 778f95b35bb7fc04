"""The installed funhooks version, read once from the package metadata (a manifest records it)."""

from importlib import metadata

__all__ = ["__version__"]

try:
    __version__ = metadata.version("funhooks")
except metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"
