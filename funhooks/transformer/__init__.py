"""One vocabulary for every transformer: the standard points (``embed``, ``resid_pre``, ``q``,
``pattern``, ``logits`` ...) of unmodified Hugging Face models, found through a table of
architectures (``architectures.py``) that users extend without editing funhooks; ``standard.py``
makes them where-values, ``views.py`` splits heads off.
May import ``errors``, ``_torch``, ``_frozen``, ``records``, ``specs`` and ``runs``.
"""

from .architectures import Architecture, architecture, register
from .standard import Point, Points, points

__all__ = ["Architecture", "Point", "Points", "architecture", "points", "register"]
