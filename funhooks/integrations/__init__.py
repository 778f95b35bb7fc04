"""Reducers inside other people's trainers: ``lightning`` (a Lightning ``Callback``) and ``hf``
(a Hugging Face ``TrainerCallback``), each imported only when used (they import their
framework), as ``fh.lightning`` and ``fh.hf``; what both share is
:mod:`funhooks.training.stepwise`. May import every package but ``testing``.
"""
