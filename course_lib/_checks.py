"""Argument checks shared by several ``course_lib`` modules (private: not part of the course's API).

One definition per check, so that every module refuses a bad argument with the same words.
"""

from __future__ import annotations

import numbers

__all__ = ["_pos_int"]


def _pos_int(name: str, v, minimum: int = 1) -> int:
    """``v`` as an ``int`` if it is an integer (not a bool) of at least ``minimum``; else a ``ValueError``
    that names the argument: ``_pos_int("top_k", 0)`` -> ``top_k must be an int >= 1, got 0``."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")
    return int(v)
