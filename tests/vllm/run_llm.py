"""Run vLLM's offline ``LLM`` for each spec given as JSON on the command line, one after
another in this process, and print one ``RESULT {json}`` line per spec: the greedy tokens, or
the error. The engine's log (our loader's line included) goes to stderr."""

from __future__ import annotations

import json
import sys
import traceback

PROMPTS = ["the quick brown", "weights stream from", "a loader hands"]


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    kwargs = {
        "model": spec["model"],
        "load_format": spec["load_format"],
        "dtype": spec.get("dtype", "float32"),
        "tensor_parallel_size": spec.get("tp", 1),
        "enforce_eager": True,
        "max_model_len": 128,
        "seed": 0,
        "model_loader_extra_config": spec.get("extra", {}),
    }
    if spec.get("tp", 1) > 1:
        kwargs["distributed_executor_backend"] = "mp"
    if spec.get("ep"):  # expert parallelism, and vLLM's filter that reads only a rank's experts
        kwargs.update(enable_expert_parallel=True, enable_ep_weight_filter=True)
    try:
        llm = LLM(**kwargs)
        if spec.get("generate", True) is False:  # the engine built and its weights loaded: enough
            del llm
            return {"ok": True, "tokens": None}
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        del llm
        return {"ok": True, "tokens": tokens}
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-4000:]}


def main() -> None:
    for spec in json.loads(sys.argv[1]):
        print("RESULT " + json.dumps(run(spec)), flush=True)


if __name__ == "__main__":
    main()
