"""The package version (a leaf: imported by the package and by dump metadata)."""

__version__ = "0.1.0"
# The distribution's name on PyPI (pip install jacobian-lens): "jlens" there is an unrelated package. The import
# name stays jlens_core and the command jlens.
DISTRIBUTION = "jacobian-lens"
