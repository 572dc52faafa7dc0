"""The library version, in one leaf module every other module may import."""

__version__ = "0.1.0"
