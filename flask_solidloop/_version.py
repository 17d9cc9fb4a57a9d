"""The version of flask-solidloop, in one place.

At the bottom of the layers, so any module may read it; pyproject.toml reads it too.
"""

__version__ = "0.1.0.dev0"
