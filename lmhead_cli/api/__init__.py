"""The Python API: `load()` a model, call a reading, get a result whose to_dict() is the CLI's --json.

    import lmhead_cli
    m = lmhead_cli.load("random:gpt2")
    r = m.inspect("The keys on the table", top_k=5, targets=[" are"])
    r.to_dict()        # == json.loads(`lmhead inspect ... --json`)

Importing this package does not import torch; load() does.
"""

from lmhead_cli.api.model import Model, load, params
from lmhead_cli.api.results import Result

__all__ = ["Model", "Result", "load", "params"]
