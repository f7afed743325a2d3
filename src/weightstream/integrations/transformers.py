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
import logging
import threading
from collections.abc import Iterator
from typing import Any

import torch

from weightstream._modules import load_into
from weightstream.config import StreamConfig
from weightstream.devices import Device
from weightstream.errors import ConfigError, StateDictError
from weightstream.uri import UriLike

__all__ = ["empty_parameters", "from_pretrained"]

log = logging.getLogger(__name__)


_LOCAL = threading.local()
_PATCH_LOCK = threading.Lock()
_USERS = 0
_ORIGINAL = torch.nn.Module.register_parameter


def _register(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
    _ORIGINAL(module, name, param)
    if getattr(_LOCAL, "depth", 0) and param is not None and param.device.type != "meta":
        kind = type(param)
        extra = param.__dict__  # e.g. transformers' or vLLM's attributes on a Parameter
        meta = kind(param.to("meta"), requires_grad=param.requires_grad)
        meta.__dict__.update(extra)
        module._parameters[name] = meta


@contextlib.contextmanager
def empty_parameters() -> Iterator[None]:
    """While inside, every parameter a module registers *in this thread* is moved to the meta
    device as it is registered (before any initialisation touches its memory); buffers are left as
    the module computes them. Other threads build modules as usual meanwhile: the hook installed
    on ``torch.nn.Module.register_parameter`` acts only for threads inside this block, and is
    removed when the last of them leaves."""
    global _USERS
    with _PATCH_LOCK:
        if _USERS == 0:
            torch.nn.Module.register_parameter = _register  # type: ignore[method-assign, assignment]
        _USERS += 1
    _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1
    try:
        yield
    finally:
        _LOCAL.depth -= 1
        with _PATCH_LOCK:
            _USERS -= 1
            if _USERS == 0:
                torch.nn.Module.register_parameter = _ORIGINAL  # type: ignore[method-assign]


DType = torch.dtype | str | None


def from_pretrained(
    model_class: Any,
    uri: UriLike,
    *,
    config: Any = None,
    dtype: DType = None,
    device: Device = "cpu",
    strict: bool = True,
    stream_config: StreamConfig | None = None,
    torch_dtype: DType = None,
) -> Any:
    """A transformers model of ``model_class`` (an ``AutoModel...`` class or a model class) with the
    weights of the checkpoint at ``uri``, in eval mode, as ``model_class.from_pretrained`` returns it.

    ``config``: the model's configuration; read from ``uri`` (a local folder) if not given.
    ``dtype`` (or its older name ``torch_dtype``): of the parameters, as ``from_pretrained`` takes
    it: a ``torch.dtype``, its name (``"bfloat16"``), or ``"auto"``: the config's ``dtype``, else the
    index's ``dtype`` metadata, else the first floating tensor's in the checkpoint. By default the
    one ``from_pretrained`` picks: ``"auto"`` with transformers 5, the default dtype (float32)
    with transformers 4. ``device``: where the weights are read to. Keys are matched as
    ``from_pretrained`` matches them (``base_model_prefix`` added or stripped, legacy
    ``gamma``/``beta`` names, keys the model declares it ignores). Tensors the model has no place
    for are left unread and logged, as ``from_pretrained`` warns about them. A checkpoint that
    leaves a weight of the model unset is refused with ``strict`` (default:
    :class:`~weightstream.errors.StateDictError`); with ``strict=False`` such weights are
    initialised by the model's ``_init_weights``, as ``from_pretrained`` does (and logged).
    ``stream_config``: weightstream's settings.
    """
    try:
        import transformers
    except ImportError:  # pragma: no cover - depends on the installation
        raise ConfigError(
            "from_pretrained needs transformers: pip install 'weightstream[transformers]'"
        ) from None
    if torch_dtype is not None:
        if dtype is not None and dtype != torch_dtype:
            raise ConfigError(f"dtype={dtype!r} and torch_dtype={torch_dtype!r} disagree", setting="dtype")
        dtype = torch_dtype
    if config is None:
        if not isinstance(uri, str | bytes) and not hasattr(uri, "__fspath__"):
            raise ConfigError("from_pretrained: pass config= when uri is a list of files", setting="config")
        config = transformers.AutoConfig.from_pretrained(str(uri))
    dtype = _dtype(dtype, config, uri, stream_config, major=int(transformers.__version__.split(".")[0]))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as from_pretrained does while it builds: for the process
    try:
        with empty_parameters():
            if hasattr(model_class, "from_config"):
                model = model_class.from_config(config)
            else:
                model = model_class(config)
    finally:
        torch.set_default_dtype(previous)
    result = load_into(model, uri, strict=False, device=device, config=stream_config)
    if result.unexpected_keys:
        log.warning(
            "%s: %d tensors of the checkpoint have no place in %s and were not read: %s",
            uri,
            len(result.unexpected_keys),
            type(model).__name__,
            ", ".join(result.unexpected_keys[:8]),
        )
    model.tie_weights()
    still_meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if still_meta:
        shown = ", ".join(still_meta[:5]) + (
            f" and {len(still_meta) - 5} more" if len(still_meta) > 5 else ""
        )
        if strict:
            raise StateDictError(
                f"from_pretrained: the checkpoint leaves {len(still_meta)} weights of "
                f"{type(model).__name__} unset ({shown}); with strict=False they are initialised as "
                "transformers initialises missing weights (at random)",
                uri=str(uri) if isinstance(uri, str) else None,
            )
        log.warning("%s: initialised as the model initialises them (not in the checkpoint): %s", uri, shown)
        _initialise(model, still_meta, device)
    return model.to(device).eval()


def _initialise(model: Any, names: list[str], device: Device) -> None:
    """Weights the checkpoint does not hold, made and initialised by the model's own
    ``_init_weights``, as ``from_pretrained`` does with ``strict``-less loads."""
    owners = {}
    for name in names:
        owner, _, leaf = name.rpartition(".")
        sub = model.get_submodule(owner) if owner else model
        param = sub._parameters[leaf]
        sub._parameters[leaf] = torch.nn.Parameter(
            torch.empty(param.shape, dtype=param.dtype, device=device), requires_grad=param.requires_grad
        )
        owners[id(sub)] = sub
    with torch.no_grad():
        for sub in owners.values():
            model._init_weights(sub)
    model.tie_weights()


def _dtype(
    dtype: DType, config: Any, uri: UriLike, stream_config: StreamConfig | None, *, major: int
) -> torch.dtype:
    """The dtype ``from_pretrained`` would build the model in (see :func:`from_pretrained`)."""
    if dtype is None:
        dtype = "auto" if major >= 5 else torch.get_default_dtype()
    if isinstance(dtype, torch.dtype):
        chosen = dtype
    elif dtype == "auto":
        named = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        chosen = _as_dtype(named) if named is not None else _checkpoint_dtype(uri, stream_config)
    elif isinstance(dtype, str):
        chosen = _as_dtype(dtype)
    else:
        raise ConfigError(f"dtype must be a torch.dtype, its name or 'auto', got {dtype!r}", setting="dtype")
    if not chosen.is_floating_point:
        raise ConfigError(
            f"a model cannot be built in {chosen} (not a floating-point dtype)", setting="dtype"
        )
    with contextlib.suppress(Exception):
        config.dtype = chosen  # as from_pretrained records it
    return chosen


def _as_dtype(value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    found = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise ConfigError(f"{value!r} is not a torch dtype", setting="dtype")
    return found


def _checkpoint_dtype(uri: UriLike, stream_config: StreamConfig | None) -> torch.dtype:
    """transformers' "auto" without a dtype in the config: the index's ``dtype`` metadata, else
    the first floating tensor's dtype (float8 and float4 skipped), else the first tensor's."""
    from weightstream.checkpoint import open_checkpoint

    with open_checkpoint(uri, config=stream_config) as ckpt:
        named = ckpt.metadata.get("dtype") if ckpt.index_uri else None
        if isinstance(named, str):
            return _as_dtype(named)
        dtypes = [t.dtype.torch for t in ckpt.tensors.values() if t.dtype.torch is not None]
    for d in dtypes:
        if d.is_floating_point and "float8_" not in str(d) and "float4_" not in str(d):
            return d
    return dtypes[0] if dtypes else torch.float32
