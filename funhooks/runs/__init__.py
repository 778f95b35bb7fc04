"""How specs meet a model: ``with_hooks`` (a run scoped to a block), ``capture`` and
``functional`` (a run as a pure function), ``activation_grads`` (d loss / d activation with
zero probes), ``attribution_patching`` (every patch of a sweep estimated from one backward).

Modules: ``run`` (``with_hooks``, ``Run``), ``pure`` (``capture``, ``functional``),
``zero_probes`` (``activation_grads``), ``attribution`` (``attribution_patching``), ``generation``
(``generate``, ``iter_generate``: a Record per decode step of a Hugging Face ``generate``),
``introspect`` (what other packages may ask about a
run's traces on a model), and ``_core/``, the run core, private to this package: the only code
that attaches anything to a model. May import: ``errors``, ``_torch``, ``_frozen``,
``distributed``, ``records``, ``specs``.
"""

from .attribution import Attribution, attribution_patching
from .generation import Generation, GenerationIterator, GenerationStep, generate, iter_generate
from .pure import capture, functional
from .run import Run, with_hooks
from .zero_probes import activation_grads

__all__ = ["Attribution", "Generation", "GenerationIterator", "GenerationStep", "Run", "activation_grads",
           "attribution_patching", "capture", "functional", "generate", "iter_generate", "with_hooks"]
