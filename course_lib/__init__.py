"""Distributed Deep Learning, hands-on: the shared course library."""

__version__ = "0.1.0"
