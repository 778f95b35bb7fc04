"""Reducers inside other people's trainers: ``lightning`` (a Lightning ``Callback``) and ``hf``
(a Hugging Face ``TrainerCallback``), each imported only when used (they import their
framework), as ``fh.lightning`` and ``fh.hf``; private ``_trainer`` holds what both share.
May import every package but ``testing``.
"""
