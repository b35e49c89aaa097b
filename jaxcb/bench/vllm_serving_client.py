"""vLLM's own serving benchmark client (`vllm bench serve`), for jaxcb's serving benchmark
with --vllm-client (bench/commands/serving.py).

This file runs in vLLM's own virtual environment, as a subprocess: it imports vllm and the
standard library only, never jaxcb. The `vllm` command fails in vLLM's CPU wheel (no package
metadata), so the client's parser and main are called here directly, with the command line
`vllm bench serve` would take:

    <vllm-venv>/bin/python vllm_serving_client.py --backend openai --base-url URL ...
"""

from __future__ import annotations

import sys


def main() -> int:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as serve_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description=__doc__.splitlines()[0])
    add_cli_args(parser)
    serve_main(parser.parse_args(sys.argv[1:]))
    return 0


if __name__ == "__main__":  # (vLLM may spawn processes)
    sys.exit(main())
