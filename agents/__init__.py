"""The node program (``python -m agents``), its protocol, and ``sim``, the simulated engine.

Nothing in this package imports Django: it runs on GPU nodes that have none.
"""

__version__ = "0.1.0"
