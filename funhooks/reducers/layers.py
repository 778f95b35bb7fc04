"""The default layers of the library's reducers, as selector predicates.

``LeafModules`` is fastai's choice for activation statistics and hook callbacks (leaf modules
with parameters); ``OwnParams`` the parameter reducers' (modules holding parameters of their
own, so every parameter belongs to exactly one selected module). Both are frozen values, so a
reducer holding one stays hashable and picklable.
"""

from __future__ import annotations

import attrs
from torch import nn

from funhooks._frozen import frozen

__all__ = ["LeafModules", "OwnParams"]


@frozen
@attrs.frozen
class LeafModules:
    """The default module selector of the hook callbacks: leaf modules with parameters
    (fastai's choice), or every leaf module with ``include_paramless=True``.

    Example:
        >>> from torch import nn
        >>> import funhooks as fh
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Sequential(nn.Linear(2, 1)))
        >>> [p for p, _ in fh.select(fh.reducers.LeafModules()).resolve(model)]
        ['0', '2.0']
    """

    include_paramless: bool = False

    def __call__(self, path: str, module: nn.Module) -> bool:
        if next(module.children(), None) is not None:
            return False
        return self.include_paramless or next(module.parameters(), None) is not None


@frozen
@attrs.frozen
class OwnParams:
    """The default selector of the parameter reducers: modules that hold parameters of their
    own (``recurse=False``), so that every parameter of the model belongs to exactly one
    selected module, leaf or not (an ``nn.MultiheadAttention``'s ``in_proj_weight``).

    Example:
        >>> from torch import nn
        >>> import funhooks as fh
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.MultiheadAttention(2, 1))
        >>> [p for p, _ in fh.select(fh.reducers.OwnParams()).resolve(model)]
        ['0', '2', '2.out_proj']
    """

    def __call__(self, path: str, module: nn.Module) -> bool:
        return next(module.parameters(recurse=False), None) is not None
