"""IncrementalDetokenizer against real tokenizers: the built-in byte-level tokenizer, a trained
byte-level BPE (its merges end inside UTF-8 characters), WordPiece ("##" pieces glue to their
left neighbour) and Metaspace (a piece's leading space depends on its position).

The reference for the streamed text is the full decode of prompt + output minus the decode of
the prompt: what the output adds to the text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from jaxcb.engine.detokenizer import IncrementalDetokenizer

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

ALPHABET = list("ab xy,.!\né日本😀")
CORPUS = [
    "héllo wörld 日本語 😀 café naïve, déjà vu!",
    "the quick brown fox jumps over the lazy dog.",
    "日本 日本 日本 😀😀 ééé ab ab xy xy, xy. ab!",
] * 20
HYPOTHESIS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _byte_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    from jaxcb.models.loading.default_model import save_byte_tokenizer

    save_byte_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


def _trained(kind: str) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=400,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=["<eos>"],
        )
    elif kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[UNK]", "<eos>"])
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<eos>"])
    tok.train_from_iterator(CORPUS, trainer)
    unk = {"unk_token": "[UNK]"} if kind == "wordpiece" else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", **unk)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    byte = _byte_tokenizer(tmp_path_factory.mktemp("byte-tokenizer"))
    return {"byte": byte, **{k: _trained(k) for k in ("bpe", "wordpiece", "metaspace")}}


@pytest.fixture(scope="module")
def byte_tok(tokenizers: dict[str, Any]) -> Any:
    return tokenizers["byte"]


def encode(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def continuation(tok: Any, prompt_ids: list[int], ids: list[int]) -> str:
    """What `ids` add to the decoded text after the prompt."""
    before = tok.decode(prompt_ids, skip_special_tokens=True)
    after = tok.decode(prompt_ids + ids, skip_special_tokens=True)
    assume(after.startswith(before))  # true of every tokenizer here but WordPiece's [UNK]
    return after[len(before) :]


def feed(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """Feed tokens one by one until a stop string; return the text after each token."""
    texts = []
    for t in ids:
        stop = detok.add_token(t)
        texts.append(detok.text)
        if stop is not None:
            break
    return texts


def text_for(tok_name: str) -> st.SearchStrategy[str]:
    if tok_name in ("byte", "bpe"):  # byte-level: any character has tokens
        chars = st.one_of(
            st.sampled_from(ALPHABET),
            st.characters(codec="utf-8", exclude_characters="\ufffd"),
        )
    else:
        chars = st.sampled_from(ALPHABET)
    return st.text(chars, min_size=1, max_size=20)


# ---- incremental text == full decode ------------------------------------------------------


@pytest.mark.parametrize("tok_name", ["byte", "bpe", "wordpiece", "metaspace"])
@HYPOTHESIS
@given(data=st.data())
def test_incremental_text_equals_full_decode(
    tokenizers: dict[str, Any], tok_name: str, data: st.DataObject
) -> None:
    tok = tokenizers[tok_name]
    prompt_ids = encode(tok, data.draw(text_for(tok_name), label="prompt"))
    ids = encode(tok, data.draw(text_for(tok_name), label="output"))
    assume(prompt_ids and ids)
    # Special tokens anywhere in the output are skipped, as the engine decodes them.
    for _ in range(data.draw(st.integers(0, 2), label="num_eos")):
        ids.insert(data.draw(st.integers(0, len(ids)), label="at"), tok.eos_token_id)
    want = continuation(tok, prompt_ids, ids)

    detok = IncrementalDetokenizer(tok, prompt_ids)
    texts = feed(detok, ids)
    for text in texts:
        assert "\ufffd" not in text, f"half a character emitted: {text!r}"
        assert want.startswith(text), f"{text!r} is not a prefix of {want!r}"
    assert detok.text == want
    assert detok.flush() is None and detok.text == want  # nothing was held back
    assert detok.visible_text(finished=False) == detok.visible_text(finished=True) == want


@HYPOTHESIS
@given(
    prompt=st.text(st.sampled_from(ALPHABET), min_size=1, max_size=8),
    output=st.text(
        st.characters(codec="utf-8", exclude_characters="\ufffd"), min_size=1, max_size=12
    ),
)
def test_byte_tokens_emit_each_character_when_complete(
    byte_tok: Any, prompt: str, output: str
) -> None:
    """Byte by byte, the text is exactly the complete characters seen so far."""
    detok = IncrementalDetokenizer(byte_tok, byte_tok(prompt)["input_ids"])
    ids = encode(byte_tok, output)
    raw = output.encode()
    assert len(ids) == len(raw)  # one token per byte
    for k, t in enumerate(ids, start=1):
        assert detok.add_token(t) is None
        assert detok.text == raw[:k].decode("utf-8", errors="ignore")


@pytest.mark.parametrize("text", ["é", "日本", "😀", "a😀b", "naïve 日本語 👍🏽"])
def test_multibyte_characters_are_never_split(byte_tok: Any, text: str) -> None:
    detok = IncrementalDetokenizer(byte_tok, byte_tok("x")["input_ids"])
    emitted = []
    for t in encode(byte_tok, text):
        detok.add_token(t)
        emitted.append(detok.text)
    # Each character appears whole, on the token carrying its last byte.
    distinct = [e for e in dict.fromkeys(emitted) if e]
    assert distinct == [text[:i] for i in range(1, len(text) + 1)]


def test_flush_emits_an_incomplete_final_character(byte_tok: Any) -> None:
    detok = IncrementalDetokenizer(byte_tok, byte_tok("x")["input_ids"])
    ids = encode(byte_tok, "ab日")[:-1]  # the last byte of 日 never comes
    feed(detok, ids)
    assert detok.text == "ab"
    detok.flush()
    assert detok.text == byte_tok.decode(ids) == "ab\ufffd"


def test_special_tokens_kept_when_asked(byte_tok: Any) -> None:
    ids = [*encode(byte_tok, "hi"), byte_tok.eos_token_id]
    skip = IncrementalDetokenizer(byte_tok, byte_tok("x")["input_ids"])
    keep = IncrementalDetokenizer(byte_tok, byte_tok("x")["input_ids"], skip_special_tokens=False)
    feed(skip, ids)
    feed(keep, ids)
    assert skip.text == "hi" and keep.text == "hi</s>"


def test_no_tokenizer_means_no_text() -> None:
    detok = IncrementalDetokenizer(None, [1, 2, 3], stop=["a"])
    assert detok.add_token(5) is None and detok.flush() is None
    assert detok.text == detok.visible_text(finished=True) == ""


# ---- stop strings -------------------------------------------------------------------------


def reference_stop(
    tok: Any, prompt_ids: list[int], ids: list[int], stops: list[str], include: bool
) -> tuple[int | None, str | None, str]:
    """(index of the token that completes a stop, the stop, final text), computed from full
    decodes: the first token after which the text holds a stop string; of the stops found
    then, the one starting earliest."""
    for k in range(1, len(ids) + 1):
        text = continuation(tok, prompt_ids, ids[:k])
        if text.endswith("\ufffd"):
            continue  # mid-character: nothing new is emitted
        found = [(text.find(s), s) for s in stops if s in text]
        if found:
            i, s = min(found)
            return k - 1, s, text[: i + len(s)] if include else text[:i]
    return None, None, continuation(tok, prompt_ids, ids)


@st.composite
def stop_cases(draw: st.DrawFn, tok_name: str) -> tuple[str, str, list[str], bool]:
    prompt = draw(text_for(tok_name), label="prompt")
    output = draw(text_for(tok_name), label="output")
    stops = []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):  # a piece of the output, so that it stops
            i = draw(st.integers(0, len(output) - 1))
            j = draw(st.integers(i + 1, min(len(output), i + 6)))
            stops.append(output[i:j])
        else:
            stops.append(draw(st.text(st.sampled_from(ALPHABET), min_size=1, max_size=4)))
    return prompt, output, stops, draw(st.booleans(), label="include_stop_str_in_output")


@pytest.mark.parametrize("tok_name", ["byte", "bpe", "wordpiece", "metaspace"])
@HYPOTHESIS
@given(data=st.data())
def test_stop_strings(tokenizers: dict[str, Any], tok_name: str, data: st.DataObject) -> None:
    tok = tokenizers[tok_name]
    prompt, output, stops, include = data.draw(stop_cases(tok_name))
    prompt_ids, ids = encode(tok, prompt), encode(tok, output)
    assume(prompt_ids and ids)
    want_k, want_stop, want_text = reference_stop(tok, prompt_ids, ids, stops, include)

    detok = IncrementalDetokenizer(tok, prompt_ids, stop=stops, include_stop_str_in_output=include)
    visible = []
    stopped_at = None
    for k, t in enumerate(ids):
        stop = detok.add_token(t)
        if stop is not None:
            stopped_at = k
            assert stop == detok.stopped_by
            break
        visible.append(detok.visible_text(finished=False))
    assert (stopped_at, detok.stopped_by) == (want_k, want_stop)
    assert detok.flush() is None
    final = detok.visible_text(finished=True)
    assert final == detok.text == want_text
    for v in visible:  # streamed text is never taken back
        assert final.startswith(v), f"streamed {v!r}, final {final!r}"
    if want_stop is not None and not include:
        assert want_stop not in final


def _run(
    tok: Any, text: str, stops: list[str], include: bool = False
) -> tuple[IncrementalDetokenizer, int | None]:
    detok = IncrementalDetokenizer(
        tok, tok("x")["input_ids"], stop=stops, include_stop_str_in_output=include
    )
    ids = encode(tok, text)
    for k, t in enumerate(ids):
        if detok.add_token(t) is not None:
            return detok, k
    return detok, None


def test_stop_string_truncates_text(byte_tok: Any) -> None:
    detok, k = _run(byte_tok, "hello world, more", ["world"])
    assert (detok.text, detok.stopped_by, k) == ("hello ", "world", len("hello world") - 1)
    detok, _ = _run(byte_tok, "hello world, more", ["world"], include=True)
    assert detok.text == "hello world"


def test_stop_string_spanning_multibyte_tokens(byte_tok: Any) -> None:
    detok, k = _run(byte_tok, "abc日本def", ["日本"])
    assert (detok.text, detok.stopped_by) == ("abc", "日本")
    assert k == len("abc日本".encode()) - 1  # found on the last byte of 本


def test_earliest_stop_wins(byte_tok: Any) -> None:
    # Both complete on the same character: the one starting earlier wins, whatever the order.
    for stops in (["bc", "abc"], ["abc", "bc"]):
        detok, _ = _run(byte_tok, "xabcd", stops)
        assert (detok.text, detok.stopped_by) == ("x", "abc")
        detok, _ = _run(byte_tok, "xabcd", stops, include=True)
        assert detok.text == "xabc"
    # One completes first: generation stops there even if a longer one would start earlier.
    detok, _ = _run(byte_tok, "hello world", ["hello world!", "lo w"])
    assert (detok.text, detok.stopped_by) == ("hel", "lo w")


def test_stop_string_in_prompt_is_ignored(byte_tok: Any) -> None:
    detok = IncrementalDetokenizer(byte_tok, byte_tok("say STOP")["input_ids"], stop=["STOP"])
    for t in encode(byte_tok, " ok"):
        assert detok.add_token(t) is None
    assert detok.visible_text(finished=True) == " ok"


def test_visible_text_holds_back_a_possible_stop_prefix(byte_tok: Any) -> None:
    detok = IncrementalDetokenizer(byte_tok, byte_tok("x")["input_ids"], stop=["xyz", "q"])
    for t in encode(byte_tok, "helloxy"):
        detok.add_token(t)
    assert detok.text == "helloxy"
    assert detok.visible_text(finished=False) == "hello"  # "xy" may become "xyz"
    assert detok.visible_text(finished=True) == "helloxy"
