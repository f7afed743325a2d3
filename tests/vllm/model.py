"""A tiny Llama made on the spot: random weights in a few shards, a BPE tokenizer trained here
with ``tokenizers``; nothing from a hub."""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "weights stream from storage into memory at the speed of the disk",
    "a loader hands over exactly the tensors the checkpoint holds",
    "inference servers wait for model weights before they answer",
    "every byte is read once, straight into the memory it will live in",
] * 40


def make_tokenizer(folder: Path) -> int:
    """A byte-level BPE tokenizer trained on :data:`CORPUS`, saved in ``folder``; its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(folder)
    return int(tok.get_vocab_size())


def make_llama(
    folder: Path, *, shards: int = 3, dtype: str = "float32", seed: int = 0, layers: int = 4
) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=make_tokenizer(folder),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype=dtype,
    )
    torch.manual_seed(seed)
    return _save(LlamaForCausalLM(config).to(getattr(torch, dtype)), folder, shards)


def make_mixtral(folder: Path, *, shards: int = 3, experts: int = 4, seed: int = 0) -> Path:
    """A tiny Mixtral (a mixture of experts: ``experts`` a layer, two of them per token), fp32."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=make_tokenizer(folder),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=experts,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return _save(MixtralForCausalLM(config), folder, shards)


def _save(model: object, folder: Path, shards: int) -> Path:
    import torch

    with torch.no_grad():
        for p in model.parameters():  # type: ignore[attr-defined]  # larger than the default init: tokens that depend on every weight
            p.normal_(0, 0.5)
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # type: ignore[attr-defined]
    model.save_pretrained(folder, safe_serialization=True, max_shard_size=total // shards + 1)  # type: ignore[attr-defined]
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return folder
