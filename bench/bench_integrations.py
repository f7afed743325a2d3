"""A transformers model made ready from a checkpoint: ``load_into`` against the usual ways.

    python bench/bench_integrations.py --dir /work/scratch/ck4 --reps 3

The checkpoint is the sample written by ``python -m weightstream.tools.sample`` (a Llama layout:
hidden 2048, intermediate 5632, vocabulary 32000). Each measurement is a fresh subprocess and
times everything from an empty process state to a model holding every weight: building the model
and loading it. Methods:

* ``load_into_meta``      model built on the meta device, ``ws.load_into`` (parameters assigned)
* ``load_into``           model materialised (``to_empty``), ``ws.load_into`` (copied in)
* ``from_pretrained``     ``transformers.AutoModelForCausalLM.from_pretrained`` (bf16)
* ``safetensors``         materialised model, ``load_state_dict(safetensors load_file of each shard)``
* ``runai``               materialised model, the Run:ai streamer's tensors copied in as they come

Cold runs follow ``drop_caches``, hot runs a read of every shard; the memory state is held
fixed as in ``bench_local.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_local import backed_memory, drop_caches, warm

METHODS = ["load_into_meta", "load_into", "from_pretrained", "safetensors", "runai"]


def llama_config(folder: str):  # type: ignore[no-untyped-def]
    import transformers

    import weightstream as ws

    ck = ws.open_checkpoint(folder)
    layers = 1 + max(int(n.split(".")[2]) for n in ck.tensors if n.startswith("model.layers."))
    vocab, hidden = ck.tensors["model.embed_tokens.weight"].shape
    inter = ck.tensors["model.layers.0.mlp.up_proj.weight"].shape[0]
    return transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )


def child(method: str, folder: str) -> dict:
    import torch
    import transformers

    import weightstream as ws

    config = llama_config(folder)
    files = sorted(str(p) for p in Path(folder).glob("*.safetensors"))
    t0 = time.perf_counter()
    if method == "from_pretrained":
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    else:
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
        if method != "load_into_meta":
            model.to_empty(device="cpu")
        if method.startswith("load_into"):
            ws.load_into(model, folder)
        elif method == "safetensors":
            from safetensors.torch import load_file

            state = {}
            for f in files:
                state.update(load_file(f))
            model.load_state_dict(state)
            del state
        elif method == "runai":
            from runai_model_streamer import SafetensorsStreamer

            params = model.state_dict()
            with torch.no_grad(), SafetensorsStreamer() as s:
                s.stream_files(files)
                for name, t in s.get_tensors():
                    params[name].copy_(t)
    # A model whose weights are lazily mapped from the files (from_pretrained does this) is not
    # ready until they are read: touch one element per 4 KiB page of every weight.
    with torch.no_grad():
        for p in model.state_dict().values():
            flat = p.reshape(-1)
            flat[:: max(1, 4096 // p.element_size())].float().sum()
    seconds = time.perf_counter() - t0
    nbytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    return {"seconds": seconds, "bytes": nbytes, "peak_rss_gib": hwm / (1 << 30)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--modes", default="cold,hot")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--json-out")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.dir)))
        return 0
    methods, modes = args.methods.split(","), args.modes.split(",")
    files = sorted(str(p) for p in Path(args.dir).glob("*.safetensors"))
    size = sum(os.path.getsize(f) for f in files)
    with tempfile.TemporaryDirectory() as tmp:
        # from_pretrained needs a config.json beside the weights; the checkpoint folder is not
        # written to: a folder of links is made instead.
        folder = Path(tmp) / "model"
        folder.mkdir()
        for f in Path(args.dir).iterdir():
            (folder / f.name).symlink_to(f.resolve())
        llama_config(args.dir).save_pretrained(folder)
        results: dict[str, dict[str, list[dict]]] = {m: {k: [] for k in methods} for m in modes}
        with backed_memory(int(size * 2.5)) as state:
            print(f"memory state: {state}", flush=True)
            for rep in range(args.reps):
                order = methods[rep % len(methods) :] + methods[: rep % len(methods)]
                for mode in modes:
                    for m in order:
                        drop_caches() if mode == "cold" else warm(files)
                        proc = subprocess.run(
                            [sys.executable, __file__, "--child", m, "--dir", str(folder)],
                            capture_output=True,
                            text=True,
                            timeout=600,
                        )
                        if proc.returncode != 0:
                            raise RuntimeError(f"{m} failed:\n{proc.stderr[-3000:]}")
                        r = json.loads(proc.stdout.strip().splitlines()[-1])
                        results[mode][m].append(r)
                        print(
                            f"rep {rep} {mode:4s} {m:16s} {r['bytes'] / r['seconds'] / 1e9:6.2f} GB/s "
                            f"{r['seconds']:6.2f} s  peak RSS {r['peak_rss_gib']:.2f} GiB",
                            flush=True,
                        )
    print(f"\nmedians over {args.reps} repetitions; GB/s = model bytes / seconds to a ready model")
    print(
        f"{'mode':4s} {'method':16s} {'GB/s':>6s} {'s':>6s} {'peak RSS GiB':>12s}  ratio load_into_meta / this"
    )
    summary: dict = {}
    for mode in modes:
        med = {m: statistics.median(r["seconds"] for r in results[mode][m]) for m in methods}
        ours = med.get("load_into_meta")
        for m in methods:
            nbytes = results[mode][m][0]["bytes"]
            rss = max(r["peak_rss_gib"] for r in results[mode][m])
            ratio = f"{med[m] / ours:.2f}" if ours else "-"
            summary.setdefault(mode, {})[m] = {
                "gb_per_s": nbytes / med[m] / 1e9,
                "seconds": med[m],
                "peak_rss_gib": rss,
                "runs_s": [round(r["seconds"], 3) for r in results[mode][m]],
            }
            print(f"{mode:4s} {m:16s} {nbytes / med[m] / 1e9:6.2f} {med[m]:6.2f} {rss:12.2f}  {ratio}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
