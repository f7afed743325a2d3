"""``load_into`` on plain torch modules: memory stays bounded (no second copy of the weights)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from safetensors.torch import save_file

import weightstream as ws

SCRIPT = textwrap.dedent(
    """
    import json, resource, sys, torch
    import weightstream as ws

    def peak():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    torch.manual_seed(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(16)])  # 256 MiB
    for p in model.parameters():
        p.data.add_(1.0)  # touch every page: the module's own memory is in the baseline
    before = peak()
    ws.load_into(model, sys.argv[1], config=ws.StreamConfig(memory_limit=16 << 20, chunk_size=4 << 20))
    growth = peak() - before
    want = torch.load(sys.argv[2])
    same = all(torch.equal(model.state_dict()[k], v) for k, v in want.items())
    print(json.dumps({"growth": growth, "same": same}))
    """
)


def test_no_second_copy_of_the_weights(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(16)])
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(tmp_path / "m.safetensors"))
    torch.save(state, tmp_path / "want.pt")
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "m.safetensors"), str(tmp_path / "want.pt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["same"]
    # 256 MiB of weights were streamed in under a 16 MiB budget: a second copy would add 256 MiB.
    assert got["growth"] < 64 << 20, got


def test_tied_parameters_and_buffers(tmp_path: Path) -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(8, 8, bias=False)
            self.b = torch.nn.Linear(8, 8, bias=False)
            self.b.weight = self.a.weight
            self.register_buffer("scale", torch.ones(8))
            self.register_buffer("scratch", torch.zeros(3), persistent=False)

    src = Tied()
    torch.nn.init.normal_(src.a.weight)
    src.scale.mul_(3)
    save_file({"a.weight": src.a.weight.detach(), "scale": src.scale}, str(tmp_path / "t.safetensors"))
    dst = Tied()
    assert ws.load_into(dst, tmp_path / "t.safetensors") == ([], [])
    assert torch.equal(dst.b.weight, src.a.weight) and dst.b.weight is dst.a.weight
    assert torch.equal(dst.scale, src.scale)


def test_extra_state_and_non_tensor_entries_are_left_alone(tmp_path: Path) -> None:
    class WithExtra(torch.nn.Linear):
        def get_extra_state(self) -> dict[str, int]:
            return {"version": 3}

        def set_extra_state(self, state: object) -> None:
            pass

    src = WithExtra(4, 4)
    save_file(
        {k: v for k, v in src.state_dict().items() if isinstance(v, torch.Tensor)},
        str(tmp_path / "x.safetensors"),
    )
    dst = WithExtra(4, 4)
    assert "_extra_state" in dst.state_dict()
    assert ws.load_into(dst, tmp_path / "x.safetensors") == ([], [])
    assert torch.equal(dst.weight, src.weight) and torch.equal(dst.bias, src.bias)
