"""Circuits on unmodified Hugging Face transformers: a model's writers, readers and edges
(``graphs.py``), edge attribution patching and EAP-IG (``edge_attribution.py``), runs keeping only
a circuit's edges and the metric they recover (``faithful.py``), their figures (``plots.py``, the
``plot`` extra), an interactive viewer of edge scores (``viewer.py``), and the passes they
share (``_passes.py``: writers recorded, readers probed or patched, through standard points).
May import ``errors``, ``_torch``, ``_viewer``, ``_frozen``, ``records``, ``specs``, ``runs``,
``reducers`` and ``transformer``.
"""

from .edge_attribution import Edges, eap
from .faithful import Curve, Faithfulness, faithfulness, faithfulness_curve
from .graphs import Graph, graph
from .plots import plot_curve, plot_edges
from .viewer import EdgeViewer, edge_viewer

__all__ = ["Curve", "EdgeViewer", "Edges", "Faithfulness", "Graph", "eap", "edge_viewer", "faithfulness",
           "faithfulness_curve", "graph", "plot_curve", "plot_edges"]
