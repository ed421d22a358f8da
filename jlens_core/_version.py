"""The package version (a leaf: imported by the package and by dump metadata)."""

__version__ = "0.1.0"
