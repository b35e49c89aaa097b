"""Perplexity of a model on a text file, through the engine's prompt logprobs.

    python scripts/eval_ppl.py --text book.txt
    python scripts/eval_ppl.py --text book.txt --model /path/to/model --dtype float32 \\
        --max-length 1024 --stride 512 --json ppl.json

Sliding windows as in Hugging Face's perplexity guide: windows of --max-length tokens every
--stride tokens, each scoring only the tokens the previous one did not (jaxcb/eval/
perplexity.py has the details). The whole file is tokenized as one text (with the
tokenizer's BOS). Prints the tokens scored, the mean NLL, the perplexity and the scored
tokens per second; --json writes them too.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from jaxcb.build import build_engine
from jaxcb.cli import add_engine_args, engine_config_from_args
from jaxcb.eval.perplexity import perplexity, sliding_windows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--text", required=True, type=Path, help="UTF-8 text file to score")
    parser.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="tokens per window (default: max_model_len, at most 1024)",
    )
    parser.add_argument(
        "--stride", type=int, default=None, help="tokens between windows (default: half a window)"
    )
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=None,
        help="windows in the engine at once (default: 2 x max_num_seqs x data_parallel_size)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING, ...")
    add_engine_args(parser)
    return parser


def read_text(path: Path) -> str:
    """The file's text; ValueError in one line if it cannot be read or is empty."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"--text {path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"--text {path}: is a directory") from None
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"--text {path}: not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None
    except OSError as exc:
        raise ValueError(f"--text {path}: {exc.strerror}") from None
    if not text.strip():
        raise ValueError(f"--text {path}: the file is empty")
    return text


def run(args: argparse.Namespace) -> dict:
    for name in ("max_length", "stride", "max_in_flight"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.max_length and args.stride and args.stride > args.max_length:
        raise ValueError(f"--stride ({args.stride}) must be <= --max-length ({args.max_length})")
    text = read_text(args.text)
    config = engine_config_from_args(args)
    engine = build_engine(config)
    try:
        if engine.tokenizer is None:
            raise ValueError("this model has no tokenizer: a text cannot be scored with it")
        ids = list(engine.tokenizer(text, verbose=False)["input_ids"])  # no length warning
        max_length = args.max_length or min(engine.max_model_len, 1024)
        stride = args.stride or max(1, max_length // 2)
        windows = sliding_windows(len(ids), max_length, stride)  # ValueError if impossible
        bar = None
        if not args.no_progress:
            from tqdm.auto import tqdm

            total = sum(w.num_scored for w in windows)
            bar = tqdm(total=total, desc="scoring", unit="tok", dynamic_ncols=True)

        def progress(num_scored: int, nll: float) -> None:
            bar.update(num_scored)

        try:
            result = perplexity(
                engine,
                ids,
                max_length=max_length,
                stride=stride,
                max_in_flight=args.max_in_flight,
                on_window=progress if bar is not None else None,
            )
        finally:
            if bar is not None:
                bar.close()
    finally:
        engine.close()
    return {"model": engine.info.model_name, "text": str(args.text), **result.to_dict()}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        figures = run(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"{figures['num_scored']:,} tokens scored ({figures['num_windows']} windows of "
        f"{figures['max_length']}, stride {figures['stride']}): mean NLL "
        f"{figures['mean_nll']:.4f}, perplexity {figures['perplexity']:.4f}, "
        f"{figures['tokens_per_second']:,.0f} tok/s"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
