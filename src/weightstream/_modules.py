"""Stream a checkpoint into a torch module's parameters and buffers (``weightstream.load_into``)."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from weightstream.checkpoint import Checkpoint, open_checkpoint
from weightstream.config import StreamConfig
from weightstream.devices import Device
from weightstream.distributed import Distributed
from weightstream.errors import ConfigError, StateDictError
from weightstream.pipeline import TensorStream, opening
from weightstream.uri import UriLike

__all__ = ["IncompatibleKeys", "load_into"]

_SHOWN = 8
log = logging.getLogger(__name__)


class IncompatibleKeys(tuple[list[str], list[str]]):
    """What ``load_into`` could not match, as ``torch.nn.Module.load_state_dict`` reports it: a
    pair ``(missing_keys, unexpected_keys)``, plus ``ignored_keys`` (not part of the pair)."""

    ignored_keys: list[str]
    """Keys the module's own rules say to ignore, left out of both lists: a transformers model's
    ``_keys_to_ignore_on_load_missing`` / ``_keys_to_ignore_on_load_unexpected`` and the buffers it
    no longer saves (``position_ids``, ``rotary_emb.inv_freq``), as ``from_pretrained`` ignores them.
    Unexpected ones among them are not read."""

    def __new__(
        cls, missing_keys: list[str], unexpected_keys: list[str], ignored_keys: list[str] | None = None
    ) -> IncompatibleKeys:
        self = super().__new__(cls, (missing_keys, unexpected_keys))
        self.ignored_keys = list(ignored_keys or [])
        return self

    @property
    def missing_keys(self) -> list[str]:
        """State-dict keys of the module that the checkpoint does not hold (left as they were)."""
        return self[0]

    @property
    def unexpected_keys(self) -> list[str]:
        """Tensors of the checkpoint that the module has no place for (not read)."""
        return self[1]

    def __repr__(self) -> str:
        return (
            f"IncompatibleKeys(missing_keys={self[0]!r}, unexpected_keys={self[1]!r}, "
            f"ignored_keys={self.ignored_keys!r})"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self[0], self[1], self.ignored_keys))


def load_into(
    module: torch.nn.Module,
    uri: UriLike,
    *,
    strict: bool = True,
    device: Device | None = None,
    config: StreamConfig | None = None,
    process_group: Any = None,
    distributed: Distributed = False,
) -> IncompatibleKeys:
    """Stream a checkpoint into ``module``'s parameters and persistent buffers as tensors arrive.

    Keys and shapes are checked against the checkpoint's headers before any tensor byte is read;
    with ``strict`` (default) a missing or unexpected key raises
    :class:`~weightstream.errors.StateDictError`, and a shape mismatch always does. Tensors the
    module has no place for are not read at all. Tied parameters (one tensor under several
    names) are filled from whichever name the checkpoint holds.

    Each tensor is copied into its parameter (converting dtype, as ``load_state_dict`` does) and
    dropped, so no second copy of the weights is ever held: memory beyond the module's own stays
    under ``config.memory_limit``. A module built on the meta device can be materialised with
    ``module.to_empty(device=...)`` first, or passed as it is: parameters still on the meta device
    are replaced by the loaded tensors (on ``device``, default CPU) in the module's dtype.

    ``device``: where tensors are read to; default the device of the module's parameters when
    they are all on one (so a CUDA module is fed through the pinned GPU path), else CPU.
    ``process_group`` / ``distributed``: as for :func:`weightstream.load`.
    """
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"load_into needs a torch.nn.Module, got {type(module).__name__}", setting="module")
    # Tensors only: a state dict may also carry ``_extra_state`` objects, which no checkpoint of
    # tensors can fill (left to the module, and not reported as missing).
    targets = {k: v for k, v in module.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}
    read_to = _read_device(device, list(targets.values()))
    with contextlib.ExitStack() as stack:  # the checkpoint is closed however this ends
        with opening(process_group, distributed, config, read_to) as load:
            ckpt = stack.enter_context(open_checkpoint(uri, config=load.config))
            plan = _Match.of(module, targets, ckpt, strict=strict)
            stream = ckpt.open_stream(load, list(dict.fromkeys([*plan.wanted, *plan.tied])))
        differ = _fill(module, targets, plan, stream)
        unexpected = plan.unexpected
        if differ:
            pairs = [f"{a} and {b}" for a, b in differ]
            if strict:
                raise StateDictError(
                    f"tied in the module, but the checkpoint holds different tensors for {_few(pairs)}",
                    uri=ckpt.uri,
                )
            log.warning("%s: tied in the module, different in the checkpoint: %s", ckpt.uri, _few(pairs))
            # The value that fills the module is the group's first name's; the others were not used.
            unexpected = [*unexpected, *sorted({n for pair in differ for n in pair if n not in plan.wanted})]
        return IncompatibleKeys(sorted(plan.missing), unexpected, plan.ignored)


@dataclass
class _Match:
    """The module's tensors against the checkpoint's names, checked before any byte is read."""

    wanted: dict[str, list[str]]
    """Checkpoint name -> every module name it fills (tied names share one tensor)."""
    tied: dict[str, list[str]]
    """Checkpoint name -> every checkpoint name of its tied group (when it holds several)."""
    missing: list[str]
    unexpected: list[str]
    ignored: list[str]

    @classmethod
    def of(
        cls, module: torch.nn.Module, targets: dict[str, torch.Tensor], ckpt: Checkpoint, *, strict: bool
    ) -> _Match:
        names_of: dict[int, list[str]] = {}  # one entry per distinct tensor; tied names share it
        for name, t in targets.items():
            names_of.setdefault(id(t), []).append(name)
        renamed = _module_keys(module, list(ckpt.tensors), targets)
        held_as: dict[str, list[str]] = {}  # module name -> checkpoint names that fill it
        for ck, name in renamed.items():
            held_as.setdefault(name, []).append(ck)
        wanted: dict[str, list[str]] = {}
        tied: dict[str, list[str]] = {}
        missing: list[str] = []
        for names in names_of.values():
            held = [ck for n in names for ck in held_as.get(n, [])]
            if held:
                wanted[held[0]] = names
                if len(held) > 1:
                    tied.update(dict.fromkeys(held, held))
            else:
                missing.extend(names)
        unexpected = [ck for ck in ckpt.tensors if renamed[ck] not in targets]
        skip_missing, skip_unexpected = _declared_ignores(module, missing, unexpected)
        missing = [n for n in missing if n not in skip_missing]
        unexpected = [n for n in unexpected if n not in skip_unexpected]
        ignored = sorted(skip_missing | skip_unexpected)
        if ignored:
            log.info("%s: ignored as the module declares: %s", ckpt.uri, _few(ignored))
        mismatched = [
            f"{n}: checkpoint {list(_shape(ckpt, n))}, module {list(targets[renamed[n]].shape)}"
            for n in [*wanted, *tied]
            if _shape(ckpt, n) != tuple(targets[renamed[n]].shape)
        ]
        problems = []
        if mismatched:
            problems.append(f"shape mismatch for {_few(dict.fromkeys(mismatched))}")
        if strict and missing:
            problems.append(f"missing from the checkpoint: {_few(sorted(missing))}")
        if strict and unexpected:
            problems.append(f"not in the module: {_few(unexpected)}")
        if problems:
            raise StateDictError("; ".join(problems), uri=ckpt.uri)
        return cls(wanted, tied, missing, unexpected, ignored)


def _fill(
    module: torch.nn.Module, targets: dict[str, torch.Tensor], plan: _Match, stream: TensorStream
) -> list[tuple[str, str]]:
    """Stream the wanted tensors into the module. A tied tensor the checkpoint holds under
    several names is read under each, and they must be one tensor: returns the pairs of names
    whose tensors differ (a file that does not fit the module)."""
    first: dict[str, tuple[str, torch.Tensor]] = {}  # group's first name -> the first to arrive
    left = {group[0]: len(group) for group in plan.tied.values()}
    differ: list[tuple[str, str]] = []
    with torch.no_grad(), stream:
        for name, tensor in stream:
            if name in plan.wanted:
                names = plan.wanted[name]
                _place(module, names, targets[names[0]], tensor)
            group = plan.tied.get(name)
            if group is not None:
                key = group[0]
                seen = first.setdefault(key, (name, tensor))
                if seen[0] != name and not _same(seen[1], tensor):
                    differ.append((seen[0], name))
                left[key] -= 1
                if not left[key]:
                    del first[key]
                del seen
            del tensor
    return differ


def _module_keys(
    module: torch.nn.Module, names: list[str], targets: dict[str, torch.Tensor]
) -> dict[str, str]:
    """Checkpoint name -> the module name it fills, by the module's own rules: a transformers
    model's renamings (legacy ``LayerNorm.gamma`` / ``.beta``, a model's registered ones) and its
    ``base_model_prefix`` added or stripped (a ``bert.``-prefixed checkpoint into a ``BertModel``,
    a base model's checkpoint into a model with a head), asked of transformers itself, as
    ``from_pretrained`` asks. A module without such rules: every name as it is."""
    prefix = getattr(module, "base_model_prefix", None)
    if not isinstance(prefix, str) or not hasattr(module, "config"):
        return {n: n for n in names}
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # transformers 4: its rules were these two, in from_pretrained itself
        return {n: _legacy_key(n, prefix, targets) for n in names}
    if not isinstance(module, PreTrainedModel):
        return {n: n for n in names}
    transforms = get_model_conversion_mapping(module)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    out = {}
    for n in names:
        key, _ = rename_source_key(n, renamings, [], prefix or None, targets)
        if key not in targets and converters and rename_source_key(key, [], converters)[1] is not None:
            raise ConfigError(
                f"tensor {n!r} needs transformers' own weight conversion for {type(module).__name__} "
                "(merged or split tensors, not a rename): load this checkpoint with transformers' "
                "from_pretrained",
                setting="module",
            )
        out[n] = key
    return out


def _legacy_key(name: str, prefix: str, targets: dict[str, torch.Tensor]) -> str:
    for old, new in ((".gamma", ".weight"), (".beta", ".bias")):
        if "LayerNorm" in name and name.endswith(old):
            name = name[: -len(old)] + new
    if prefix and name not in targets:
        if name.startswith(prefix + ".") and name[len(prefix) + 1 :] in targets:
            return name[len(prefix) + 1 :]
        if f"{prefix}.{name}" in targets:
            return f"{prefix}.{name}"
    return name


def _declared_ignores(
    module: torch.nn.Module, missing: list[str], unexpected: list[str]
) -> tuple[set[str], set[str]]:
    """The missing and unexpected keys the module's own rules say to ignore (a transformers model:
    what ``from_pretrained`` leaves out of its report). Asked of the model itself where it can say
    (transformers 5: ``_adjust_missing_and_unexpected_keys``), else from the patterns it declares."""
    adjust = getattr(module, "_adjust_missing_and_unexpected_keys", None)
    if callable(adjust):
        info = SimpleNamespace(missing_keys=set(missing), unexpected_keys=set(unexpected))
        try:
            adjust(info)
            return set(missing) - set(info.missing_keys), set(unexpected) - set(info.unexpected_keys)
        except (TypeError, AttributeError):  # another transformers version's signature
            pass
    out = []
    for keys, attr in (
        (missing, "_keys_to_ignore_on_load_missing"),
        (unexpected, "_keys_to_ignore_on_load_unexpected"),
    ):
        patterns = list(getattr(module, attr, None) or [])
        rule = re.compile("|".join(f"({p})" for p in patterns)) if patterns else None
        out.append({k for k in keys if rule is not None and rule.search(k)})
    return out[0], out[1]


def _shape(ckpt: Checkpoint, name: str) -> tuple[int, ...]:
    entry = ckpt.tensors[name]
    return entry.torch_shape or entry.shape


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.to(a.device).reshape(-1).view(torch.uint8)))


def _few(items: Iterable[str]) -> str:
    items = list(items)
    more = f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more


def _read_device(device: Device | None, targets: list[torch.Tensor]) -> Device:
    if device is not None:
        return device
    devices = {t.device for t in targets if t.device.type != "meta"}
    return devices.pop() if len(devices) == 1 else "cpu"


def _place(module: torch.nn.Module, names: list[str], target: torch.Tensor, tensor: torch.Tensor) -> None:
    if target.device.type != "meta":
        target.copy_(tensor)  # into the module's own memory, dtype converted; ``tensor`` is then dropped
        return
    value = tensor if tensor.dtype == target.dtype else tensor.to(target.dtype)
    if isinstance(target, torch.nn.Parameter):
        value = torch.nn.Parameter(value, requires_grad=target.requires_grad)
    for name in names:  # tied names keep sharing one tensor
        owner, _, leaf = name.rpartition(".")
        sub = module.get_submodule(owner) if owner else module
        if leaf in sub._parameters:
            sub._parameters[leaf] = value  # type: ignore[assignment]
        else:
            sub._buffers[leaf] = value
