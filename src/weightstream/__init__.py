"""weightstream: stream safetensors checkpoints into tensors at the full bandwidth of the storage.

>>> import weightstream
>>> tensors = weightstream.load("/models/llama/")                  # dict name -> tensor
>>> for name, t in weightstream.stream("/models/llama/"):          # as each tensor arrives
...     model.load_state_dict({name: t}, strict=False)

Importing the package, its errors or its settings is cheap: torch and the storage clients load
with the first name that needs them (``weightstream.load`` and the rest, PEP 562).
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing

from weightstream import _process as _process  # sees every fork after this import
from weightstream import errors
from weightstream.config import StreamConfig
from weightstream.sources import registry as _registry  # the schemes URIs may have (no backend loads)

if _typing.TYPE_CHECKING:
    from weightstream._api import load, stream
    from weightstream._modules import IncompatibleKeys, load_into
    from weightstream._safe_open import safe_open
    from weightstream.checkpoint import Checkpoint, open_checkpoint
    from weightstream.pipeline import LoadStats, TensorStream

__all__ = [
    "Checkpoint",
    "IncompatibleKeys",
    "LoadStats",
    "StreamConfig",
    "TensorStream",
    "__version__",
    "errors",
    "load",
    "load_into",
    "open_checkpoint",
    "register_backend",
    "safe_open",
    "stream",
]

__version__ = "0.1.0"

register_backend = _registry.register_backend

_LAZY = {
    "load": "weightstream._api",
    "stream": "weightstream._api",
    "Checkpoint": "weightstream.checkpoint",
    "LoadStats": "weightstream.pipeline",
    "TensorStream": "weightstream.pipeline",
    "open_checkpoint": "weightstream.checkpoint",
    "IncompatibleKeys": "weightstream._modules",
    "load_into": "weightstream._modules",
    "safe_open": "weightstream._safe_open",
}


def __getattr__(name: str) -> _typing.Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'weightstream' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
