"""Training as values: ``Step`` (one step, frozen), ``train``/``evaluate`` (generators of
steps), the reducer protocol with ``fold``/``fold_all``/``fit``/``running``, ``folding`` (reducers
folded over a loop you write), optimizer watches, the progress bar, and ``Logged`` (reducers'
``Scalars`` written to TensorBoard as they are computed).

Modules: ``step``, ``loops``, ``folds``, ``own_loop``, ``watch``, ``progress``, ``logged``, ``recorder``
(one step's recording, shared by every producer of steps), ``stepwise`` (reducers advanced by
the steps a trainer brackets: what the trainer integrations build on), and private
``_one_step`` (what one step does, the loops' argument checks), ``_batches`` (batches as
pytrees).
May import: ``errors``, ``_torch``, ``_frozen``, ``_modes``, ``records``, ``specs``, ``runs``.
"""

from . import progress
from .folds import Reducer, fit, fold, fold_all, running
from .logged import Logged, Scalars
from .loops import evaluate, train
from .own_loop import Folding, folding
from .step import Step
from .watch import Layers, OptimizerWatch

__all__ = [
    "Folding", "Layers", "Logged", "OptimizerWatch", "Reducer", "Scalars", "Step", "evaluate", "fit", "fold", "fold_all",
    "folding", "progress", "running", "train",
]
