"""jaxtdist's version, in a module of its own.

Modules inside the package that need it (the tuning cache keys its entries
by it) import it from here: asking ``jaxtdist/__init__.py`` for it would make
them depend on the package that imports them.

Example:
  >>> from jaxtdist._version import __version__
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
