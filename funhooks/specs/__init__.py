"""What to hook: selectors (where), ``Spec`` values (when and what) and their constructors:
module specs, op specs, intervention specs and fastai's spellings.

Modules: ``selector`` (every spelling of "where" normalised into a frozen ``Selector``),
``spec`` (``Spec`` and ``outputs``/``inputs``/``grads``/``observe``/``edit``), ``fastai``
(``Hook``, ``Hooks``, ``hook_output``, ``hook_outputs``), ``ops`` (specs on the torch ops a
module's forward calls, and how ops are named), ``interventions`` (``patch``, ``steer``,
``scale``, ``ablate``, ``arg``), ``editing`` (what an intervention does to each value), ``decoding`` (``steps``: decode steps as
positions), ``attention`` (``attention_pattern``, ``attention_scores``: op values under eager
and SDPA attention).
Specs are plain values: nothing here touches a model. May import: ``errors``, ``_torch``,
``_frozen``, ``records``.
"""

from .attention import attention_pattern, attention_scores
from .fastai import Hook, Hooks, hook_output, hook_outputs
from .interventions import Arg, ablate, arg, patch, scale, steer
from .ops import Op, op, op_edit, op_inputs, op_outputs
from .selector import Selector, select
from .spec import EVENTS, Spec, edit, grads, inputs, observe, outputs
from .decoding import Steps, steps

__all__ = [
    "EVENTS", "Arg", "Hook", "Hooks", "Op", "Selector", "Spec", "ablate", "arg", "attention_pattern",
    "attention_scores", "edit", "grads",
    "hook_output", "hook_outputs", "inputs", "observe", "op", "op_edit", "op_inputs", "op_outputs",
    "outputs", "patch", "scale", "select", "steer", "steps", "Steps",
]
