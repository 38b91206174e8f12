"""The Python API: `load()` a model, call a reading, get a result whose to_dict() is the CLI's --json.

    import lmhead_cli
    m = lmhead_cli.load("random:gpt2")
    r = m.inspect("The keys on the table", top_k=5, targets=[" are"])
    r.to_dict()        # == json.loads(`lmhead inspect ... --json`)

Importing this package does not import torch; load() does. Its names are imported on first use, so
that a front end's start-up can read the light modules (api.choices: the stage registry and the values
its options offer) without the Model's.
"""

__all__ = ["Model", "Result", "hand_over", "load", "model_params", "own_process", "params", "toy"]

_FROM = {"Model": "model", "load": "model", "model_params": "model", "params": "arithmetic", "toy": "arithmetic",
         "own_process": "process", "hand_over": "process", "Result": "results"}


def __getattr__(name: str):
    """`lmhead_cli.api.load` and the rest of __all__, from their modules, imported when first asked for."""
    if name in _FROM:
        import importlib

        return getattr(importlib.import_module(f"lmhead_cli.api.{_FROM[name]}"), name)
    raise AttributeError(f"module 'lmhead_cli.api' has no attribute {name!r}")
