"""One vocabulary for every transformer: the standard points (``embed``, ``resid_pre``, ``q``,
``pattern``, ``logits`` ...) of unmodified Hugging Face models, found through a table of
architectures (``architectures.py``) that users extend without editing funhooks.
May import ``errors``, ``_torch``, ``_frozen``, ``records``, ``specs`` and ``runs``.
"""

from .architectures import Architecture, architecture, register

__all__ = ["Architecture", "architecture", "register"]
