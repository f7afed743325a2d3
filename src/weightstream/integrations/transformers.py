"""transformers models made ready to run from a checkpoint, with weightstream reading the weights.

``from_pretrained`` builds a model and reads its weights; so does :func:`from_pretrained` here,
with weightstream doing the reading::

    from transformers import AutoModelForCausalLM
    from weightstream.integrations.transformers import from_pretrained

    model = from_pretrained(AutoModelForCausalLM, "/models/llama-3-8b/")   # eval mode, like theirs

How, and why not ``torch.device("meta")`` then ``to_empty()``: a model's non-persistent buffers
(``position_ids``, rotary ``inv_freq``) are in no checkpoint; its ``__init__`` computes them. A
model built on the meta device has none, ``to_empty()`` gives them uninitialised memory, and the
model then computes garbage, or fails with an index out of range. Here only *parameters* go to
the meta device while the model is built (:func:`empty_parameters`): no parameter memory is
allocated or initialised, buffers are computed as usual, and :func:`weightstream.load_into` then
puts each loaded tensor in place of its meta parameter. Tied parameters stay tied. The outputs
are bit-identical to transformers' ``from_pretrained`` (tested on all-MiniLM-L6-v2 and on a
Llama).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from weightstream._modules import load_into
from weightstream.checkpoint import Device
from weightstream.config import StreamConfig
from weightstream.errors import ConfigError
from weightstream.uri import UriLike

__all__ = ["empty_parameters", "from_pretrained"]


@contextlib.contextmanager
def empty_parameters() -> Iterator[None]:
    """While inside, every parameter a module registers is moved to the meta device as it is
    registered (before any initialisation touches its memory); buffers are left as the module
    computes them. Not thread-safe: it patches ``torch.nn.Module.register_parameter``."""
    original = torch.nn.Module.register_parameter

    def register(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            kind = type(param)
            extra = param.__dict__  # e.g. transformers' or vLLM's attributes on a Parameter
            meta = kind(param.to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(extra)
            module._parameters[name] = meta

    torch.nn.Module.register_parameter = register  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]


def from_pretrained(
    model_class: Any,
    uri: UriLike,
    *,
    config: Any = None,
    dtype: torch.dtype | None = None,
    device: Device = "cpu",
    strict: bool = True,
    stream_config: StreamConfig | None = None,
) -> Any:
    """A transformers model of ``model_class`` (an ``AutoModel...`` class or a model class) with the
    weights of the checkpoint at ``uri``, in eval mode, as ``model_class.from_pretrained`` returns it.

    ``config``: the model's configuration; read from ``uri`` (a local folder) if not given.
    ``dtype``: of the parameters; by default the one ``from_pretrained`` picks (the config's
    ``dtype`` / ``torch_dtype``, else float32). ``device``: where the weights are read to.
    ``strict``: as for :func:`weightstream.load_into` (keys the model declares to ignore are
    ignored, as ``from_pretrained`` ignores them). ``stream_config``: weightstream's settings.
    """
    try:
        import transformers
    except ImportError:  # pragma: no cover - depends on the installation
        raise ConfigError(
            "from_pretrained needs transformers: pip install 'weightstream[transformers]'"
        ) from None
    if config is None:
        if not isinstance(uri, str | bytes) and not hasattr(uri, "__fspath__"):
            raise ConfigError("from_pretrained: pass config= when uri is a list of files", setting="config")
        config = transformers.AutoConfig.from_pretrained(str(uri))
    if dtype is None:
        # transformers 5 keeps it as ``dtype`` (``torch_dtype`` is a deprecated alias there), 4.x as ``torch_dtype``
        dtype = (
            config.dtype if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
        ) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with empty_parameters():
            if hasattr(model_class, "from_config"):
                model = model_class.from_config(config)
            else:
                model = model_class(config)
    finally:
        torch.set_default_dtype(previous)
    load_into(model, uri, strict=strict, device=device, config=stream_config)
    model.tie_weights()
    still_meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if still_meta:
        raise ConfigError(
            f"from_pretrained: the checkpoint left {len(still_meta)} parameters unset "
            f"({', '.join(still_meta[:5])}); with strict=False they must be initialised by hand"
        )
    return model.to(device).eval()
