from __future__ import annotations

import inspect

import weightstream as ws
from weightstream import errors


def test_public_names_are_exactly_all() -> None:
    public = {n for n in dir(ws) if not n.startswith("_")}
    # subpackages are importable internals, not API; everything else public is in __all__
    internals = {
        "annotations",
        "config",
        "engine",
        "format",
        "memory",
        "sources",
        "uri",
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
    for fn in (ws.load, ws.stream):
        params = inspect.signature(fn).parameters
        assert list(params) == ["uri", "device", "config", "tensors", "process_group", "distributed"]
        assert all(p.kind is p.KEYWORD_ONLY for n, p in params.items() if n != "uri")
        assert params["device"].default == "cpu"
    params = inspect.signature(ws.load_into).parameters
    assert list(params)[:2] == ["module", "uri"] and params["strict"].default is True
    assert all(p.kind is p.KEYWORD_ONLY for n, p in params.items() if n not in ("module", "uri"))
