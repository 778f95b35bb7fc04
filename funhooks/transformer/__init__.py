"""One vocabulary for every transformer: the standard points (``embed``, ``resid_pre``, ``q``,
``pattern``, ``logits`` ...) of unmodified Hugging Face models, found through a table of
architectures (``architectures.py``) that users extend without editing funhooks; ``standard.py``
makes them where-values, ``views.py`` splits heads off; each head's weights and its ``result``
(``heads.py``); the residual stream as a sum of its writers and direct logit attribution
(``decompose.py``); the logit lens and unembedding (``lens.py``); figures of patching tables,
attention patterns and logit lenses (``plots.py``); interactive viewers of attention patterns
(``viewer.py``) and patching tables (``patching.py``), self-contained HTML and JavaScript.
May import ``errors``, ``_torch``, ``_html``, ``_viewer``, ``_frozen``, ``records``, ``specs``, ``runs`` and ``reducers``.
"""

from .architectures import Architecture, architecture, register
from .decompose import Decomposition, decompose_resid, logit_attrs, stack_head_results
from .heads import HeadWeights, head_weights
from .lens import LogitLens, ResidualStack, accumulated_resid, logit_lens, unembed
from .patching import PatchingViewer, patching_viewer
from .plots import plot_logit_lens, plot_patching, plot_patterns
from .standard import Point, Points, points
from .viewer import PatternViewer, pattern_viewer

__all__ = ["Architecture", "Decomposition", "HeadWeights", "LogitLens", "PatchingViewer", "PatternViewer", "Point", "Points", "ResidualStack",
           "accumulated_resid", "architecture", "decompose_resid", "head_weights", "logit_attrs", "logit_lens",
           "patching_viewer", "pattern_viewer", "plot_logit_lens", "plot_patching", "plot_patterns", "points", "register", "stack_head_results", "unembed"]
