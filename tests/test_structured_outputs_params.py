"""StructuredOutputsParams' validation, the grammar compiler and matcher on the tiny model's
byte tokenizer, and the device's token mask against a plain unpacking."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from transformers import AutoTokenizer

from jaxcb import SamplingParams
from jaxcb.engine.grammar import GrammarCompiler, mask_words
from jaxcb.models.loading.default_model import CONFIG, default_model_dir
from jaxcb.sampling import apply_token_mask
from jaxcb.structured_outputs import StructuredOutputsParams


def test_params_shape_checks_and_keys():
    so = SamplingParams(structured_outputs={"choice": ["a", "b"]}).structured_outputs
    assert isinstance(so, StructuredOutputsParams) and so.kind == "choice"
    assert so.choice == ("a", "b")
    same = StructuredOutputsParams(json='{"type": "object"}').key()
    assert same == StructuredOutputsParams(json='{"type": "object"}').key()
    a = StructuredOutputsParams(json={"b": 1, "a": 2}).key()
    assert a == StructuredOutputsParams(json={"a": 2, "b": 1}).key()  # key order ignored
    for bad, match in [
        ({}, "exactly one of"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"json_object": False}, "exactly one of"),
        ({"choice": ["a", 3]}, "choice must be"),
        ({"grammar": "  "}, "grammar must be"),
        ({"json": 5}, "json must be a JSON schema"),
        ({"regex": "a", "disable_any_whitespace": 1}, "disable_any_whitespace must be"),
    ]:
        with pytest.raises(ValueError, match=match) as err:
            SamplingParams(structured_outputs=bad)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="must be an object"):
        SamplingParams(structured_outputs="json")


@pytest.fixture(scope="module")
def compiler():
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    return GrammarCompiler(tok, CONFIG["vocab_size"], [CONFIG["eos_token_id"]]), tok


def allowed(matcher, vocab_size: int) -> set[int]:
    mask = np.zeros((1, mask_words(vocab_size)), np.int32)
    matcher.fill(mask, 0)
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab_size]
    return set(np.flatnonzero(bits).tolist())


def test_matcher_walks_a_choice_to_its_end(compiler):
    grammars, tok = compiler
    grammar = grammars.compile(StructuredOutputsParams(choice=["ab", "ac"]))
    assert grammars.compile(StructuredOutputsParams(choice=["ab", "ac"])) is grammar  # cached
    assert grammars.num_compiled == 1 and grammars.cache_hits == 1
    m = grammars.matcher(grammar)
    a, b, c = (tok.convert_tokens_to_ids(tok.tokenize(ch))[0] for ch in "abc")
    assert allowed(m, CONFIG["vocab_size"]) == {a}
    m.accept(a)
    assert allowed(m, CONFIG["vocab_size"]) == {b, c} and not m.is_finished
    with pytest.raises(ValueError, match="breaks the structured output"):
        grammars.matcher(grammar).accept(b)
    m.accept(c)
    assert m.is_finished or allowed(m, CONFIG["vocab_size"]) == {CONFIG["eos_token_id"]}
    assert grammars.compile(None) is None


def test_compiler_without_tokenizer_is_a_one_line_error():
    with pytest.raises(ValueError, match="needs a tokenizer"):
        GrammarCompiler(None, 320, [2]).compile(StructuredOutputsParams(regex="a"))


def test_token_mask_on_device_matches_the_bits():
    rng = np.random.default_rng(0)
    vocab = 77  # not a multiple of 32: the last word is partly past the vocabulary
    mask = rng.integers(-(2**31), 2**31, (3, mask_words(vocab)), dtype=np.int64).astype(np.int32)
    mask[1] = -1  # an unconstrained row
    logits = rng.standard_normal((3, vocab)).astype(np.float32)
    got = np.asarray(apply_token_mask(jnp.asarray(logits), jnp.asarray(mask)))
    bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, :vocab] == 1
    np.testing.assert_array_equal(got, np.where(bits, logits, -np.inf))
    np.testing.assert_array_equal(got[1], logits[1])
