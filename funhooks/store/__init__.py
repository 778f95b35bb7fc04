"""Activation datasets: ``ActivationWriter`` streams Records into safetensors shards,
``collect`` runs a model over inputs into a store, ``ActivationDataset`` reads every rank's
committed shards back, memory-mapped.

Modules: ``writer`` (``ActivationWriter``, ``WriterState``), ``collecting`` (``collect``),
``dataset`` (``ActivationDataset``), ``stats`` (``ColumnStats``, the statistics written with each
shard), ``streaming`` (``ActivationStream``, shuffled, split, resumable reading), ``hf_datasets``
(``to_hf_dataset``, ``from_hf_dataset``), and private ``_shards`` (shard files), ``_manifest`` (the
per-rank JSON Lines manifest), ``_sink`` (one rank open for writing) and ``_rows`` (a Record
made rows), ``_fingerprint`` (what ``collect`` was fed). May import: ``errors``, ``_torch``, ``_frozen``, ``_modes``, ``records``, ``specs``,
``runs``, ``training``.
"""

from .collecting import collect
from .dataset import MAX_OPEN_SHARDS, ActivationDataset
from .hf_datasets import HF_CHUNK_ROWS, from_hf_dataset, to_hf_dataset
from .stats import STATS_CHUNK_ROWS, ColumnStats
from .streaming import BLOCK_ROWS, SHUFFLE_BUFFER_ROWS, ActivationStream
from .writer import ActivationWriter, WriterState

__all__ = ["BLOCK_ROWS", "HF_CHUNK_ROWS", "MAX_OPEN_SHARDS", "SHUFFLE_BUFFER_ROWS", "STATS_CHUNK_ROWS",
           "ActivationDataset", "ActivationStream", "ActivationWriter", "ColumnStats", "WriterState", "collect",
           "from_hf_dataset", "to_hf_dataset"]
