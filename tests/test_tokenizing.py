"""jaxcb/tokenizing.py: the lower bound on a text's tokens holds, and is refused where the
tokenizer's pipeline may drop or merge characters."""

from __future__ import annotations

import random

import pytest
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from jaxcb.tokenizing import max_token_chars, min_num_tokens


@pytest.fixture(scope="module")
def builtin_tokenizer():
    from jaxcb.models.loading.default_model import default_model_dir
    from jaxcb.models.loading.loader import load_tokenizer

    return load_tokenizer(default_model_dir())


def test_the_bound_holds_on_the_builtin_tokenizer(builtin_tokenizer):
    max_chars = max_token_chars(builtin_tokenizer)
    assert max_chars == max(len(t) for t in builtin_tokenizer.get_vocab())
    rng = random.Random(0)
    alphabet = "ab xyz\n\té漢🙂<s></s><pad>"
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        for add_special_tokens in (True, False):
            ids = builtin_tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
            assert len(ids) >= min_num_tokens(text, max_chars), text
    assert min_num_tokens("x" * 11, 5) == 3
    assert min_num_tokens("x" * 11, None) == 0


def _fast(model, normalizer=None, pre_tokenizer=None) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(model)
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    if pre_tokenizer is not None:
        tokenizer.pre_tokenizer = pre_tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


VOCAB = {"a": 0, "b": 1, "ab": 2, "<unk>": 3, "▁": 4, "▁ab": 5}
MERGES = [("a", "b"), ("▁", "ab")]


def _bpe(**kwargs) -> models.BPE:
    return models.BPE(dict(VOCAB), list(MERGES), unk_token="<unk>", **kwargs)


LLAMA2_LIKE = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])


CASES = {  # name: (tokenizer, its bound)
    "llama2-like": (lambda: _fast(_bpe(fuse_unk=True, byte_fallback=True), LLAMA2_LIKE), 5),
    "byte-level": (lambda: _fast(_bpe(), pre_tokenizer=pre_tokenizers.ByteLevel()), 5),
    "nfc": (lambda: _fast(_bpe(byte_fallback=True), normalizers.NFC()), 20),  # 4 code points: 1
    # characters dropped or merged: no bound
    "whitespace": (lambda: _fast(_bpe(), pre_tokenizer=pre_tokenizers.Whitespace()), None),
    "regex-replace": (lambda: _fast(_bpe(), normalizers.Replace(Regex(" +"), " ")), None),
    "strip": (lambda: _fast(_bpe(), normalizers.Strip()), None),
    "fused-unk": (lambda: _fast(_bpe(fuse_unk=True)), None),
    "wordpiece": (lambda: _fast(models.WordPiece(dict(VOCAB), unk_token="<unk>")), None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_which_tokenizers_get_a_bound(case):
    make, want = CASES[case]
    assert max_token_chars(make()) == want


def test_a_fused_unknown_run_is_why_there_is_no_bound():
    tokenizer = _fast(_bpe(fuse_unk=True))
    text = "日本語" * 10
    assert len(tokenizer(text)["input_ids"]) < len(text) / 5  # one <unk> for the whole run
