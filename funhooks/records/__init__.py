"""What a run gives back: ``Record``, the immutable tree of stored values keyed by module path,
and ``RecordNode``, one module's values.

Modules: ``record`` (the Record: lookups, ``map``, pytree registration, save/load; ``merge``,
several Records as one), ``node``
(``RecordNode`` and how a lookup that misses explains itself), ``_file`` (the file format of
``Record.save``/``Record.load``), ``_compare`` (exact comparison of stored values).
May import: ``errors``, ``_torch``, ``_html``, ``_frozen``. Nothing here knows about specs or runs.
"""

from .node import Calls, RecordData, RecordNode, StoredValue
from .record import Record, merge

__all__ = ["Calls", "Record", "RecordData", "RecordNode", "StoredValue", "merge"]
