"""Benchmark an OpenAI-compatible server (jaxcb, `vllm serve`, TGI) the way `vllm bench serve`
does: same options, same metric definitions, same printed labels, so results compare.

Requests are sent at Poisson arrivals (--request-rate, Gamma inter-arrival times with
--burstiness: 1 is Poisson, lower is burstier; inf sends everything at once), at most
--max-concurrency in flight, each streamed (`"stream": true`) and timed by this client from
just before its POST: TTFT, TPOT, ITL and E2EL (mean, median, percentiles), throughput and
goodput (shared/BENCHMARKS.md, "Metrics"). Greedy, `max_tokens` from the dataset.

    python scripts/serve.py --model DIR --port 8000 &                        # any server
    python -m jaxcb.bench serving --base-url http://127.0.0.1:8000 --tokenizer DIR \\
        --dataset-name random --num-prompts 200 --random-input-len 128 \\
        --random-output-len 64 --random-range-ratio 0.5 --request-rate 4 --ignore-eos \\
        --goodput ttft:500 tpot:50 --seed 0 --save-result --result-dir out

Datasets: `random` sends token-id prompts (lengths exact whatever the tokenizer; the
vocabulary size comes from --tokenizer's config or --vocab-size); `sharegpt` reads
--dataset-path (a ShareGPT JSON file), filtered as vLLM filters it, and needs --tokenizer;
`chat` sends the real chat requests of the offline benchmark's chat workloads (--chat-workload:
chat-fixed, EOS ignored at drawn lengths, or chat-natural, to the end of the turn), as token
ids chat-templated by --tokenizer (a preset such as smollm2-135m, or a model dir), in order.

    MODEL=$(python -m jaxcb.bench.models smollm2-135m)
    python scripts/serve.py --model $MODEL --config configs/serve-smollm2-cpu.yaml --port 8000 &
    python -m jaxcb.bench serving --port 8000 --tokenizer smollm2-135m --dataset-name chat \
        --num-prompts 128 --request-rate 2 --save-result --result-dir out

The result (vLLM's keys: the metrics, every request's lengths, TTFT and ITLs, with the
machine and the flags) goes to --json PATH, or with --save-result to --result-dir under
vLLM's file name (--result-filename to choose). --model is the model name sent to the
server, as in `vllm bench serve`, not a model to load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from jaxcb.bench.cli import resolve_model
from jaxcb.bench.serving_client import (
    Endpoint,
    SampleRequest,
    arrival_offsets,
    get_json,
    random_requests,
    run_requests,
    send_request,
    sharegpt_requests,
)
from jaxcb.bench.serving_metrics import METRICS, calculate_metrics, format_report, parse_goodput

DESCRIPTION = "any OpenAI-compatible server under load, `vllm bench serve`'s options and metrics"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", help="server URL, e.g. http://127.0.0.1:8000 (or --host/--port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--endpoint",
        default="/v1/completions",
        help="/v1/completions or /v1/chat/completions (%(default)s)",
    )
    p.add_argument("--model", help="model name to send (default: the server's first model)")
    p.add_argument(
        "--tokenizer", help="Hugging Face tokenizer/model dir (sharegpt lengths, vocab size)"
    )
    p.add_argument("--vocab-size", type=int, help="random token ids below this (default: model's)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--dataset-name", default="random", choices=["random", "sharegpt", "chat"])
    p.add_argument(
        "--chat-workload",
        default="chat-fixed",
        choices=["chat-fixed", "chat-natural"],
        help="the chat dataset's workload (%(default)s)",
    )
    p.add_argument("--dataset-path", help="ShareGPT JSON file (--dataset-name sharegpt)")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--random-prefix-len", type=int, default=0)
    p.add_argument(
        "--random-num-prefixes",
        type=int,
        default=1,
        help="each random prompt starts with one of this many --random-prefix-len prefixes "
        "(groups of shared prefixes, as prefix routing sees them; default: one for all)",
    )
    p.add_argument("--sharegpt-output-len", type=int, help="fixed output length (sharegpt)")
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second; inf sends all at once (%(default)s)",
    )
    p.add_argument(
        "--burstiness", type=float, default=1.0, help="Gamma shape of the arrivals; 1 = Poisson"
    )
    p.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM extension)")
    p.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="NAME:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 (e2el too)",
    )
    p.add_argument(
        "--percentile-metrics",
        default=",".join(METRICS),
        help="metrics whose percentiles are reported (%(default)s)",
    )
    p.add_argument("--metric-percentiles", default="99", help="comma list (%(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument(
        "--save-result",
        action="store_true",
        help="write the result to --result-dir under vLLM's file name (unless --json)",
    )
    p.add_argument("--result-dir", type=Path, default=Path("."))
    p.add_argument("--result-filename", help="(default: BACKEND-RATEqps-MODEL-DATE.json)")
    p.add_argument("--label", default="openai", help="name of the server in the result")
    p.add_argument(
        "--vllm-client",
        type=Path,
        metavar="PYTHON",
        help="time with vLLM's own client (vllm.benchmarks.serve) instead, run by this python "
        "of vLLM's venv with the same flags (random and sharegpt datasets); its result keys "
        "are vLLM's",
    )
    p.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    try:
        args.goodput_slos = parse_goodput(args.goodput)
    except ValueError as exc:
        p.error(str(exc))
    args.selected = [m for m in args.percentile_metrics.split(",") if m]
    if any(m not in METRICS for m in args.selected):
        p.error(f"--percentile-metrics takes names from {list(METRICS)}")
    try:
        args.percentiles = [float(x) for x in args.metric_percentiles.split(",") if x]
    except ValueError:
        p.error("--metric-percentiles wants numbers, e.g. 50,90,99")
    if any(not 0 < x <= 100 for x in args.percentiles):
        p.error("--metric-percentiles must be in (0, 100]")
    if args.num_prompts < 1 or (args.max_concurrency is not None and args.max_concurrency < 1):
        p.error("--num-prompts and --max-concurrency must be >= 1")
    if args.dataset_name == "sharegpt" and not (args.dataset_path and args.tokenizer):
        p.error("--dataset-name sharegpt needs --dataset-path and --tokenizer")
    if args.dataset_name == "chat" and not args.tokenizer:
        p.error("--dataset-name chat needs --tokenizer (e.g. smollm2-135m)")
    if args.vllm_client is not None:
        if not args.vllm_client.is_file():
            p.error(f"--vllm-client: no such file: {args.vllm_client}")
        if args.dataset_name == "chat" or args.random_num_prefixes != 1 or args.vocab_size:
            p.error(
                "--vllm-client takes vLLM's datasets: random (one shared prefix at most, "
                "token ids from --tokenizer) or sharegpt"
            )
        if not args.tokenizer:
            p.error("--vllm-client needs --tokenizer (vLLM's client tokenizes)")
    args.base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def load_tokenizer(path: str | None) -> Any:
    if path is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_model(path)))


def chat_requests(args: argparse.Namespace) -> list[SampleRequest]:
    """The first --num-prompts requests of --chat-workload, token ids; a fixed-length workload
    turns --ignore-eos on."""
    from jaxcb.bench.workloads import make_workload

    workload = make_workload(
        args.chat_workload, num_requests=args.num_prompts, model_dir=resolve_model(args.tokenizer)
    )
    if workload.ignore_eos and not args.ignore_eos:
        print(f"{workload.name} ignores EOS: sending ignore_eos")
        args.ignore_eos = True
    return [
        SampleRequest(list(r.prompt_token_ids), len(r.prompt_token_ids), r.max_tokens)
        for r in workload.requests
    ]


def vocab_size(args: argparse.Namespace, tokenizer: Any) -> int:
    if args.vocab_size:
        return args.vocab_size
    config = resolve_model(args.tokenizer) / "config.json" if args.tokenizer else None
    if config is not None and config.is_file():
        return int(json.loads(config.read_text())["vocab_size"])
    if tokenizer is not None:
        return len(tokenizer)
    raise SystemExit("serving: the random dataset needs --tokenizer DIR or --vocab-size")


def sample_requests(args: argparse.Namespace) -> list[SampleRequest]:
    tokenizer = load_tokenizer(args.tokenizer)
    if args.dataset_name == "chat":
        requests = chat_requests(args)
        if args.endpoint.endswith("chat/completions"):
            raise SystemExit(
                "serving: the chat dataset is already chat-templated: send it to /v1/completions"
            )
        return requests
    if args.dataset_name == "sharegpt":
        return sharegpt_requests(
            args.dataset_path,
            args.num_prompts,
            tokenizer=tokenizer,
            seed=args.seed,
            output_len=args.sharegpt_output_len,
        )
    requests = random_requests(
        args.num_prompts,
        input_len=args.random_input_len,
        output_len=args.random_output_len,
        range_ratio=args.random_range_ratio,
        vocab_size=vocab_size(args, tokenizer),
        seed=args.seed,
        prefix_len=args.random_prefix_len,
        num_prefixes=args.random_num_prefixes,
    )
    if args.endpoint.endswith("chat/completions"):  # chat takes text only
        if tokenizer is None:
            raise SystemExit("serving: the chat endpoint needs --tokenizer")
        for r in requests:
            r.prompt = tokenizer.decode(r.prompt)
    return requests


async def benchmark(args: argparse.Namespace, requests: list[SampleRequest]) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model
    if model is None:
        listing = await get_json(f"{args.base_url}/v1/models", headers)
        model = listing["data"][0]["id"]
    endpoint = Endpoint(
        url=args.base_url + args.endpoint,
        model=model,
        chat=args.endpoint.endswith("chat/completions"),
        headers=headers,
        ignore_eos=args.ignore_eos,
    )
    print("Starting initial single prompt test run...")
    test = await send_request(endpoint, requests[0], t0=time.perf_counter(), timeout=600)
    if not test.success:
        raise SystemExit(f"serving: the test request failed: {test.error}")
    print("Initial test run completed. Starting main benchmark run...")
    print(f"Traffic request rate: {args.request_rate}")
    print(
        f"Burstiness factor: {args.burstiness} ({'Poisson' if args.burstiness == 1 else 'Gamma'})"
    )
    print(f"Maximum request concurrency: {args.max_concurrency}")

    offsets = arrival_offsets(len(requests), args.request_rate, args.burstiness, args.seed)
    bar = None
    if not args.disable_tqdm:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), unit="req", dynamic_ncols=True)
    try:
        results, duration = await run_requests(
            endpoint,
            requests,
            offsets,
            max_concurrency=args.max_concurrency,
            on_done=(lambda _: bar.update(1)) if bar is not None else None,
            timeout=args.request_timeout,
        )
    finally:
        if bar is not None:
            bar.close()
    metrics = calculate_metrics(
        results, duration, goodput=args.goodput_slos or None, percentiles=args.percentiles
    )
    print(
        format_report(
            metrics,
            request_rate=args.request_rate,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            selected=args.selected,
            percentiles=args.percentiles,
        )
    )
    errors = [r.error for r in results if not r.success]
    if errors:
        print(f"first errors: {errors[:3]}", file=sys.stderr)
    return dict(
        model_id=model,
        **metrics,
        input_lens=[r.prompt_len for r in results],
        output_lens=[r.output_len for r in results],
        ttfts=[r.ttft for r in results],
        itls=[r.itl for r in results],
        start_times=[r.start_time for r in results],
        generated_texts=[r.generated_text for r in results],
        errors=[r.error for r in results],
    )


def vllm_client_argv(args: argparse.Namespace, model: str, result: Path) -> list[str]:
    """`vllm bench serve`'s command line for the same run, its result to `result`."""
    argv = ["--backend", "openai-chat" if args.endpoint.endswith("chat/completions") else "openai"]
    argv += ["--base-url", args.base_url, "--endpoint", args.endpoint, "--model", model]
    argv += ["--tokenizer", str(resolve_model(args.tokenizer))]
    argv += ["--dataset-name", args.dataset_name, "--num-prompts", str(args.num_prompts)]
    if args.dataset_name == "random":
        argv += ["--random-input-len", str(args.random_input_len)]
        argv += ["--random-output-len", str(args.random_output_len)]
        argv += ["--random-range-ratio", str(args.random_range_ratio)]
        argv += ["--random-prefix-len", str(args.random_prefix_len)]
    else:
        argv += ["--dataset-path", str(args.dataset_path)]
        if args.sharegpt_output_len:
            argv += ["--sharegpt-output-len", str(args.sharegpt_output_len)]
    argv += ["--request-rate", str(args.request_rate), "--burstiness", str(args.burstiness)]
    if args.max_concurrency:
        argv += ["--max-concurrency", str(args.max_concurrency)]
    if args.ignore_eos:
        argv.append("--ignore-eos")
    if args.goodput:
        argv += ["--goodput", *args.goodput]
    argv += ["--percentile-metrics", args.percentile_metrics]
    argv += ["--metric-percentiles", args.metric_percentiles, "--seed", str(args.seed)]
    argv += ["--save-result", "--save-detailed", "--result-dir", str(result.parent)]
    argv += ["--result-filename", result.name, "--label", args.label]
    return argv + (["--disable-tqdm"] if args.disable_tqdm else [])


def run_vllm_client(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's own client on the same flags (in its venv, bench/vllm_serving_client.py); its
    report goes to this terminal, its result (vLLM's keys) comes back."""
    import subprocess
    import tempfile

    from jaxcb.bench.vllm_system import vllm_environment

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model
    if model is None:
        model = asyncio.run(get_json(f"{args.base_url}/v1/models", headers))["data"][0]["id"]
    script = Path(__file__).resolve().parent.parent / "vllm_serving_client.py"
    with tempfile.TemporaryDirectory(prefix="jaxcb-vllm-client-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [str(args.vllm_client), str(script), *vllm_client_argv(args, model, out)]
        env = vllm_environment(args.vllm_client, "default")
        if args.api_key:
            env["OPENAI_API_KEY"] = args.api_key
        done = subprocess.run(cmd, env=env, check=False)
        if done.returncode != 0 or not out.is_file():
            raise SystemExit(f"serving: vLLM's client failed (exit status {done.returncode})")
        return json.loads(out.read_text())


def run(args: argparse.Namespace, record: dict[str, Any]) -> int:
    """The run; the machine line is the client's machine (the server's too when local)."""
    if args.vllm_client is not None:
        result = run_vllm_client(args) | {"client": "vllm.benchmarks.serve"}
    else:
        result = asyncio.run(benchmark(args, sample_requests(args)))
    record |= dict(
        date=datetime.now().strftime("%Y%m%d-%H%M%S"),
        backend=args.label,
        base_url=args.base_url,
        endpoint=args.endpoint,
        tokenizer_id=args.tokenizer,
        dataset_name=args.dataset_name,
        num_prompts=args.num_prompts,
        request_rate=args.request_rate if args.request_rate != float("inf") else "inf",
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        goodput=args.goodput_slos,
        seed=args.seed,
        **dict(kv.split("=", 1) for kv in args.metadata if "=" in kv),
    )
    record |= result  # (vLLM's client's own result names some of the same keys)
    if args.save_result and args.json is None:  # vLLM's file name, in --result-dir
        rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g}"
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        name = args.result_filename or (
            f"{args.label}-{rate}qps{concurrency}-{Path(result['model_id']).name}-"
            f"{record['date']}.json"
        )
        args.json = args.result_dir / name  # written by the entry point, as --json is
    return 0 if result["failed"] == 0 else 1
