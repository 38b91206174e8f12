"""lmhead: make the last step of a language model visible."""

__version__ = "0.1.0"
