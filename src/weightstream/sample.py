"""The sample checkpoint writer lives in :mod:`weightstream.tools.sample`; this name stays so that
``python -m weightstream.sample OUT_DIR`` and ``from weightstream.sample import write_checkpoint``
keep working."""

from __future__ import annotations

from weightstream.tools.sample import main, transformer_layout, write_checkpoint, write_safetensors

__all__ = ["main", "transformer_layout", "write_checkpoint", "write_safetensors"]

if __name__ == "__main__":
    raise SystemExit(main())
