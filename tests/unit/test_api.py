from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import weightstream as ws
from weightstream import errors


def test_public_names_are_exactly_all() -> None:
    public = {n for n in dir(ws) if not n.startswith("_")}
    # subpackages are importable internals, not API; everything else public is in __all__
    internals = {
        "annotations",
        "cache",
        "config",
        "engine",
        "format",
        "memory",
        "sources",
        "uri",
        "checkpoint",
        "location",
        "localfs",
        "pipeline",
        "devices",
        "progress",
        "shard",
        "tools",
        "cli",
        "sample",
        "tuning",
        "distributed",
        "compat",
        "integrations",
        "Any",
        "Iterable",
        "torch",
        "UriLike",
    }
    assert public - internals == set(ws.__all__) - {"__version__"}
    for name in ws.__all__:
        assert hasattr(ws, name)


def test_errors_all_is_complete() -> None:
    classes = {
        n
        for n, v in vars(errors).items()
        if inspect.isclass(v) and issubclass(v, Exception) and v.__module__ == errors.__name__
    }
    assert classes == set(errors.__all__)
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.WeightStreamError)


def test_signatures_are_the_promised_ones() -> None:
    promised = ["uri", "device", "config", "tensors", "process_group", "distributed"]
    for fn, extended in ((ws.load, []), (ws.stream, ["borrow_cached"])):
        params = inspect.signature(fn).parameters
        assert list(params) == promised + extended  # extended at the end, never renamed
        assert all(p.kind is p.KEYWORD_ONLY for n, p in params.items() if n != "uri")
        assert params["device"].default == "cpu"
    assert inspect.signature(ws.stream).parameters["borrow_cached"].default is False


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_borrow_cached_takes_a_bool_only(tmp_path: Path, value: object) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"x": torch.ones(3)}, str(path))
    with pytest.raises(errors.ConfigError, match="borrow_cached must be True or False") as info:
        ws.stream(path, borrow_cached=value)  # type: ignore[arg-type]
    assert info.value.setting == "borrow_cached"
    params = inspect.signature(ws.load_into).parameters
    assert list(params)[:2] == ["module", "uri"] and params["strict"].default is True
    assert all(p.kind is p.KEYWORD_ONLY for n, p in params.items() if n not in ("module", "uri"))


# -- arguments of the wrong type: a ConfigError that says what is accepted, never a TypeError from deep inside


BAD_URIS = [b"/path", None, 3, 3.5, bytearray(b"x"), [b"a.safetensors"], ["a.safetensors", None], {"a": 1}]


@pytest.mark.parametrize("uri", BAD_URIS, ids=repr)
@pytest.mark.parametrize("call", ["load", "stream", "open_checkpoint", "load_into"])
def test_a_uri_of_a_wrong_type_says_what_uri_accepts(uri: object, call: str) -> None:
    fn = {
        "load": lambda: ws.load(uri),  # type: ignore[arg-type]
        "stream": lambda: ws.stream(uri),  # type: ignore[arg-type]
        "open_checkpoint": lambda: ws.open_checkpoint(uri),  # type: ignore[arg-type]
        "load_into": lambda: ws.load_into(torch.nn.Linear(2, 2), uri),  # type: ignore[arg-type]
    }[call]
    with pytest.raises(errors.ConfigError, match=r"uri must be a path .* or a list of files") as info:
        fn()
    assert type(uri).__name__ in str(info.value)
    assert info.value.setting == "uri"


def test_other_arguments_of_a_wrong_type(tmp_path: Path) -> None:
    p = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(2)}, str(p))
    with pytest.raises(errors.ConfigError, match=r"config must be a weightstream\.StreamConfig"):
        ws.load(p, config={"chunk_size": 1 << 20})  # type: ignore[arg-type]
    with pytest.raises(errors.ConfigError, match="tensors must hold tensor names"):
        ws.load(p, tensors=[1])  # type: ignore[list-item]
    with pytest.raises(errors.ConfigError, match="tensors must be an iterable"):
        ws.load(p, tensors=5)  # type: ignore[arg-type]
    with pytest.raises(errors.ConfigError, match="device"):
        ws.load(p, device=3.5)  # type: ignore[arg-type]
    with pytest.raises(errors.ConfigError, match=r"torch\.nn\.Module"):
        ws.load_into({"a": torch.ones(2)}, p)  # type: ignore[arg-type]
    assert torch.equal(ws.load(p, tensors=iter(["a"]))["a"], torch.ones(2))  # any iterable of names


def test_every_error_pickles_with_all_its_attributes() -> None:
    """Errors cross process boundaries (multiprocessing, launchers): class, message and every
    attribute survive, subclasses' own (DistributedError.rank, ConfigError.setting) included."""
    import pickle

    from weightstream.compat import runai

    classes = [getattr(errors, n) for n in errors.__all__]
    classes += [
        c for c in vars(runai).values() if inspect.isclass(c) and issubclass(c, errors.WeightStreamError)
    ]
    for cls in classes:
        err = cls("why", uri="s3://b/k", tensor="t" * 300, byte_range=(4, 8))
        err.extra = {"note": 1}  # type: ignore[attr-defined]
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is cls and str(back) == str(err) and back.args == err.args, cls
        assert back.__dict__ == err.__dict__, cls
        assert len(str(err)) < 400  # a long tensor name is shortened in the message
    d = pickle.loads(pickle.dumps(errors.DistributedError("rank 1 failed", rank=1)))
    assert d.rank == 1
    c = pickle.loads(pickle.dumps(errors.ConfigError("bad", setting="io_timeout")))
    assert c.setting == "io_timeout"


def test_importing_the_errors_the_settings_and_the_cli_loads_no_torch(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``import weightstream.errors``, ``weightstream --help``, ``inspect`` (headers only) and
    ``recommend`` start without torch (they took 2-6 s before, all of it importing torch and the
    engine)."""
    import subprocess
    import sys

    import torch
    from safetensors.torch import save_file

    path = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(3, 4)}, str(path))
    code = (
        "import sys\n"
        "import weightstream, weightstream.errors, weightstream.config\n"
        "from weightstream.cli.main import build_parser, main\n"
        "build_parser()\n"
        "assert main(['recommend', '--instance', 'p5.48xlarge', '--model-size', '700GB']) == 0\n"
        f"assert main(['inspect', {str(path)!r}, '--summary']) == 0\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n"
        "assert weightstream.__version__ and weightstream.errors.WeightStreamError\n"
        "weightstream.load\n"
        "assert 'torch' in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "weightstream", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "inspect" in out.stdout


def test_the_version_is_written_once() -> None:
    """The package's version lives in ``weightstream.__version__``; the project metadata takes it
    from there (an installed copy reports the same)."""
    import importlib.metadata
    import re
    from pathlib import Path

    import weightstream

    text = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    project = text.split("\n[project]\n", 1)[1].split("\n[", 1)[0]
    assert not re.search(r"^version\s*=", project, re.M)  # no second copy in [project]
    assert re.search(r'^dynamic = \["version"\]', project, re.M)
    assert re.search(r'^version = \{ attr = "weightstream.__version__" \}', text, re.M)
    assert importlib.metadata.version("weightstream") == weightstream.__version__
