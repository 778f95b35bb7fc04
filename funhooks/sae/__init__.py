"""Sparse autoencoders spliced into a model: ``splice`` (an SAE at one point: its features
recorded, edited, decoded with the error term), the feature edits (``ablate``, ``steer``,
``scale``, ``patch``), ``evaluate`` (reconstruction, sparsity and downstream loss of an SAE
over a dataset or an ``ActivationStream``), and the protocol an SAE follows (``protocol``).
May import ``errors``, ``_torch``, ``_frozen``, ``records``, ``specs``, ``runs`` and ``transformer``.
"""

from .edits import Edit, FeatureEdit, ablate, patch, scale, steer
from .evaluation import Evaluation, Reconstruction, evaluate
from .protocol import Autoencoder, Shape, shape_of
from .splicing import FEATURES, splice

__all__ = ["FEATURES", "Autoencoder", "Edit", "Evaluation", "FeatureEdit", "Reconstruction", "Shape", "ablate", "evaluate", "patch",
           "scale", "shape_of", "splice", "steer"]
