"""One-shot generation from the command line.

    python scripts/generate.py "Hello, my name is" --max-tokens 32
    python scripts/generate.py --model /path/to/hf_model --config configs/tiny-cpu.yaml "Hi"

With no --model it runs the built-in tiny random-weight model (its text is noise).
"""

from __future__ import annotations

import argparse
import logging
import sys

from jaxcb import LLM, SamplingParams
from jaxcb.cli import add_engine_args, engine_config_from_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("prompts", nargs="*", default=["Hello, my name is"], help="prompt text(s)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ...")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        config = engine_config_from_args(args)
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.sampling_seed,
        )
        llm = LLM(config=config)
        outputs = llm.generate(args.prompts, params)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for out in outputs:
        print(f"\n--- prompt: {out.prompt!r}")
        print(f"completion: {out.text!r}")
        print(f"tokens: {out.token_ids}  finish_reason: {out.finish_reason}")
    stats = llm.stats()
    print(
        f"\n{stats['steps']} steps, buckets {stats['bucket_histogram']}, padding "
        f"{stats['padding_fraction']:.0%}, compile {stats['compile_seconds']:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
