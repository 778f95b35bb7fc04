"""Activation datasets: ``ActivationWriter`` streams Records into safetensors shards,
``collect`` runs a model over inputs into a store, ``ActivationDataset`` reads every rank's
committed shards back, memory-mapped.

Modules: ``writer`` (``ActivationWriter``, ``WriterState``), ``collecting`` (``collect``),
``dataset`` (``ActivationDataset``), ``stats`` (``ColumnStats``, the statistics written with each
shard), ``streaming`` (``ActivationStream``, shuffled, split, resumable reading), and private ``_shards`` (shard files), ``_manifest`` (the
per-rank JSON Lines manifest), ``_sink`` (one rank open for writing) and ``_rows`` (a Record
made rows). May import: ``errors``, ``_torch``, ``_frozen``, ``_modes``, ``records``, ``specs``,
``runs``, ``training``.
"""

from .collecting import collect
from .dataset import MAX_OPEN_SHARDS, ActivationDataset
from .stats import STATS_CHUNK_ROWS, ColumnStats
from .streaming import BLOCK_ROWS, SHUFFLE_BUFFER_ROWS, ActivationStream
from .writer import ActivationWriter, WriterState

__all__ = ["BLOCK_ROWS", "MAX_OPEN_SHARDS", "SHUFFLE_BUFFER_ROWS", "STATS_CHUNK_ROWS", "ActivationDataset",
           "ActivationStream", "ActivationWriter", "ColumnStats", "WriterState", "collect"]
