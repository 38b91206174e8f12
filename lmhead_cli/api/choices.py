"""What a front end offers before any model loads: the decoding stages' registry (one option per stage),
the sources that need no network, and the default --chunk figures. Torch-free: the command
line builds its options, its help and its completions from these at start-up."""

from __future__ import annotations

from lmhead_cli.decoding.stages import SETTINGS, STAGES, checked, from_text, option  # noqa: F401 - the registry: no torch
from lmhead_cli.readings.toy import MAX_DRAWS as MAX_TOY_DRAWS  # noqa: F401 - toy --draws' bound
from lmhead_cli.chunks import CHUNK_BYTES, COMPARE_BUFFERS, FLOAT32_BYTES, SCORE_BUFFERS, default_chunk

__all__ = ["SETTINGS", "STAGES", "checked", "from_text", "option", "offline_sources", "chunk_default", "logits_bytes_per_position", "COMPARE_BUFFERS",
           "FLOAT32_BYTES", "MAX_TOY_DRAWS"]

REFERENCE, REFERENCE_NAME = "gpt2", "GPT-2"  # the bundled config that help texts quote figures for


def offline_sources() -> list[str]:
    """The sources that load without the hub or a folder: random:NAME for each bundled config,
    bundled:NAME for each bundled model."""
    from lmhead_cli.data import names as bundled_names
    from lmhead_cli.loading.model_configs import config_names

    return [f"random:{n}" for n in config_names()] + bundled_names()


def reference_vocab() -> int:
    """The vocabulary size of REFERENCE's bundled config (50,257 for GPT-2)."""
    from lmhead_cli.loading.model_configs import load_config

    return load_config(REFERENCE)["vocab_size"]


def chunk_default(command: str) -> str:
    """--chunk's default as the help shows it, computed for REFERENCE's vocabulary: "the most within
    32 MiB: 83 for GPT-2" (score) or 41 (compare, which holds twice the buffers)."""
    buffers = {"score": SCORE_BUFFERS, "compare": COMPARE_BUFFERS}[command]
    return f"the most within {CHUNK_BYTES >> 20} MiB: {default_chunk(reference_vocab(), buffers)} for {REFERENCE_NAME}"


def logits_bytes_per_position() -> int:
    """One position's float32 logits for REFERENCE's vocabulary, in bytes (201,028 for GPT-2)."""
    return reference_vocab() * FLOAT32_BYTES
