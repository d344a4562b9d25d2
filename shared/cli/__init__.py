"""The ``pdserve`` console script (``main.py``), ``pdserve up`` (``launcher.py``) and the offline
test-model maker (``tiny_model.py``)."""

from shared.cli.main import main

__all__ = ["main"]
