"""scripts/eval_ppl.py: the perplexity of a tiny random Llama (with a byte tokenizer) on a
short English text equals transformers' on the same weights, computed with torch by the
recipe of Hugging Face's perplexity guide; the windows are the guide's; bad input is one
line on stderr."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import make_hf_model

from jaxcb.eval.perplexity import perplexity, sliding_windows
from jaxcb.models.loading.default_model import save_byte_tokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "eval_ppl.py"
MAX_LENGTH, STRIDE = 96, 40
ENGINE = ["--dtype", "float32", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
          "--token-buckets", "64", "--max-model-len", "128", "--page-size", "16",
          "--num-pages", "64"]  # fmt: skip


def load_script():
    spec = importlib.util.spec_from_file_location("eval_ppl", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def guide_scored(num_tokens: int, max_length: int, stride: int) -> list[list[int]]:
    """The positions each window of the guide's loop scores: labels outside the last
    trg_len are -100, and the causal shift drops the window's first label."""
    scored, prev_end = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + max_length, num_tokens)
        trg_len = end - prev_end
        scored.append([t for t in range(end - trg_len, end) if t > begin])
        prev_end = end
        if end == num_tokens:
            break
    return [s for s in scored if s]


def guide_nll(model, ids: list[int], max_length: int, stride: int) -> tuple[float, int]:
    """transformers' summed NLL and token count, window by window as the guide computes them
    (each window's mean loss times the tokens it averaged over)."""
    import torch

    nll_sum, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + max_length, len(ids))
        trg_len = end - prev_end
        input_ids = torch.tensor([ids[begin:end]])
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            loss = model(input_ids, labels=target_ids).loss
        num_loss_tokens = int((target_ids[:, 1:] != -100).sum())
        if num_loss_tokens:
            nll_sum += float(loss) * num_loss_tokens
            count += num_loss_tokens
        prev_end = end
        if end == len(ids):
            break
    return nll_sum, count


@pytest.mark.parametrize(
    ("num_tokens", "max_length", "stride"),
    [(600, 96, 40), (600, 96, 96), (97, 96, 1), (50, 96, 40), (2, 2, 1)],
)
def test_windows_are_the_guide_s(num_tokens, max_length, stride):
    windows = sliding_windows(num_tokens, max_length, stride)
    got = [list(range(w.first_scored, w.end)) for w in windows]
    assert got == guide_scored(num_tokens, max_length, stride)
    flat = [t for s in got for t in s]
    assert len(flat) == len(set(flat))  # no token scored twice


def test_perplexity_equals_transformers(tmp_path, capsys):
    from transformers import AutoTokenizer

    model = make_hf_model("llama3", tmp_path / "model")
    save_byte_tokenizer(tmp_path / "model")
    text = json.__doc__  # real English, not this project's
    (tmp_path / "text.txt").write_text(text)
    out = tmp_path / "ppl.json"
    argv = ["--model", str(tmp_path / "model"), "--text", str(tmp_path / "text.txt"),
            "--max-length", str(MAX_LENGTH), "--stride", str(STRIDE), "--json", str(out),
            *ENGINE]  # fmt: skip
    assert load_script().main(argv) == 0
    figures = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "tokens scored" in printed and "perplexity" in printed and "tok/s" in printed

    ids = AutoTokenizer.from_pretrained(tmp_path / "model")(text)["input_ids"]
    nll_sum, count = guide_nll(model, ids, MAX_LENGTH, STRIDE)
    assert figures["num_tokens"] == len(ids) > 500
    assert figures["num_scored"] == count == len(ids) - 1
    assert figures["perplexity"] == pytest.approx(math.exp(nll_sum / count), rel=1e-3)
    assert figures["mean_nll"] == pytest.approx(nll_sum / count, rel=1e-5)
    assert figures["tokens_per_second"] > 0 and figures["num_windows"] == len(
        sliding_windows(len(ids), MAX_LENGTH, STRIDE)
    )


def test_help_and_one_line_errors(tmp_path, capsys):
    help_text = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, check=True
    ).stdout
    for flag in ("--text", "--max-length", "--stride", "--json", "--model", "--page-size"):
        assert flag in help_text
    (tmp_path / "empty.txt").write_text(" \n\n")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00abc")
    (tmp_path / "ok.txt").write_text("hello")
    ok = ["--text", str(tmp_path / "ok.txt")]
    cases = {
        "no such file": ["--text", str(tmp_path / "missing.txt")],
        "the file is empty": ["--text", str(tmp_path / "empty.txt")],
        "not UTF-8": ["--text", str(tmp_path / "binary.txt")],
        "is a directory": ["--text", str(tmp_path)],
        "--stride (64) must be <= --max-length (32)": [*ok, "--max-length", "32", "--stride", "64"],
        "--max-length must be >= 1": [*ok, "--max-length", "0"],
    }
    script = load_script()
    for message, argv in cases.items():
        assert script.main(argv) == 2, message
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_library_errors():
    engine = SimpleNamespace(max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len=64"):
        perplexity(engine, list(range(100)), max_length=128, stride=64)
    for kw, message in [
        (dict(max_length=1, stride=1), "max_length must be >= 2"),
        (dict(max_length=8, stride=9), "stride must be in"),
        (dict(max_length=8, stride=0), "stride must be in"),
    ]:
        with pytest.raises(ValueError, match=message):
            sliding_windows(100, **kw)
    with pytest.raises(ValueError, match="nothing to score"):
        sliding_windows(1, 8, 4)
