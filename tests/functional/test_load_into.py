"""``load_into`` on plain torch modules: memory stays bounded (no second copy of the weights)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import weightstream as ws
from weightstream.errors import StateDictError

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


class ThreeTied(torch.nn.Module):
    """``a``, ``b`` and ``c`` share one weight (as an embedding, an output head and an MTP head do)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8, bias=False)
        self.b = torch.nn.Linear(8, 8, bias=False)
        self.c = torch.nn.Linear(8, 8, bias=False)
        self.b.weight = self.a.weight
        self.c.weight = self.a.weight


@pytest.mark.parametrize("held", [("a", "b"), ("b", "c"), ("a", "b", "c")])
def test_tied_parameters_the_file_holds_twice_must_be_equal(tmp_path: Path, held: tuple[str, ...]) -> None:
    """The file holds a tied weight under several names. Equal copies load; different ones are
    refused with strict=True (as safetensors' load_model refuses them), and reported otherwise,
    instead of one being kept and the others never looked at."""
    w = torch.randn(8, 8)
    p = tmp_path / "same.safetensors"
    save_file({f"{n}.weight": w.clone() for n in held}, str(p))
    model = ThreeTied()
    assert ws.load_into(model, p) == ([], [])
    assert torch.equal(model.c.weight, w) and model.c.weight is model.a.weight

    other = {f"{n}.weight": w.clone() for n in held}
    last = f"{held[-1]}.weight"
    other[last][3, 4] += 1  # one element differs
    p = tmp_path / "differ.safetensors"
    save_file(other, str(p))
    with pytest.raises(
        StateDictError, match="tied in the module, but the checkpoint holds different tensors"
    ) as info:
        ws.load_into(ThreeTied(), p)
    assert last in str(info.value) and str(p) in str(info.value)
    model = ThreeTied()
    result = ws.load_into(model, p, strict=False)
    assert last in result.unexpected_keys and f"{held[0]}.weight" not in result.unexpected_keys
    assert torch.equal(model.a.weight, other[f"{held[0]}.weight"])  # the first name the module knows


def test_tied_copies_that_differ_in_dtype_are_different(tmp_path: Path) -> None:
    w = torch.randn(8, 8)
    p = tmp_path / "dt.safetensors"
    save_file({"a.weight": w, "b.weight": w.to(torch.float64)}, str(p))
    with pytest.raises(StateDictError, match="different tensors"):
        ws.load_into(ThreeTied(), p)


def test_tied_parameters_on_the_meta_device_are_checked_too(tmp_path: Path) -> None:
    w = torch.randn(8, 8)
    p = tmp_path / "m.safetensors"
    save_file({"a.weight": w, "b.weight": w + 1, "c.weight": w.clone()}, str(p))
    with torch.device("meta"):
        model = ThreeTied()
    with pytest.raises(StateDictError, match=r"a\.weight and b\.weight"):
        ws.load_into(model, p)
