"""lmhead: make the last step of a language model visible.

    import lmhead_cli
    m = lmhead_cli.load("random:gpt2")      # torch is imported here, not by `import lmhead_cli`
    m.inspect("The keys on the table").to_dict()
"""

__version__ = "0.1.0"

__all__ = ["load", "__version__"]


def __getattr__(name: str):
    """`lmhead_cli.load` (and `lmhead_cli.Model`) from lmhead_cli.api, imported on first use."""
    if name in ("load", "Model"):
        from lmhead_cli import api

        return getattr(api, name)
    raise AttributeError(f"module 'lmhead_cli' has no attribute {name!r}")
