"""The real-model benchmark pieces without the real model or any peer: the chat workloads
(deterministic, chat-templated by the model's own tokenizer), natural-length checks, the
llama.cpp system against a stand-in llama-server, and the benchmarks' flags for them."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import REPO

from jaxcb import native
from jaxcb.bench.base import check_lengths, cut_at_stop
from jaxcb.bench.commands import command_parser, load, main
from jaxcb.bench.commands.single_stream import paired, parse_llama_bench, share_of_limit
from jaxcb.bench.llamacpp_system import LlamaCppSystem, completion_payload, parse_completion
from jaxcb.bench.models import MODEL_PRESETS, save_word_tokenizer
from jaxcb.bench.smollm2 import resolve_gguf
from jaxcb.bench.systems import BenchContext
from jaxcb.bench.text_workload import Topic, take_passage
from jaxcb.bench.workloads import TEXT_FIXED_LEN, BenchRequest, make_workload, single_request
from jaxcb.models.loading.default_model import default_model_dir


@pytest.fixture(scope="module")
def chat_model() -> Path:
    """The tiny built-in model: a byte tokenizer with a chat template, EOS </s> = 2."""
    return default_model_dir()


# ---- the chat workloads --------------------------------------------------------------------


def test_chat_workloads_are_deterministic_and_chat_templated(chat_model):
    from transformers import AutoTokenizer

    fixed = make_workload("chat-fixed", num_requests=12, model_dir=chat_model)
    again = make_workload("chat-fixed", num_requests=12, model_dir=chat_model)
    natural = make_workload("chat-natural", num_requests=12, model_dir=chat_model)
    few = make_workload("chat-fixed", num_requests=3, model_dir=chat_model)
    assert fixed.requests == again.requests and few.requests == fixed.requests[:3]
    prompts = [r.prompt_token_ids for r in fixed.requests]
    assert prompts == [r.prompt_token_ids for r in natural.requests]

    assert fixed.ignore_eos and fixed.stops == ()
    assert all(TEXT_FIXED_LEN[0] <= r.max_tokens <= TEXT_FIXED_LEN[1] for r in fixed.requests)
    assert not natural.ignore_eos and natural.stops == (2,)
    assert {r.max_tokens for r in natural.requests} == {256}

    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    for ids in prompts:
        text = tokenizer.decode(ids)
        assert text.startswith("<|user|>\n") and text.endswith("\n<|assistant|>\n")
        message = text.removeprefix("<|user|>\n").removesuffix("\n<|assistant|>\n")
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        assert list(rendered) == ids  # templated once, the same ids a server would build
    lengths = sorted(map(len, prompts))
    assert lengths[0] < 100 < lengths[-1]  # short questions and passages
    info = fixed.summary()["source"]
    assert info["source"] == "pydoc_data.topics" and len(info["sha256"]) == 64


def test_chat_workload_needs_a_chat_template(tmp_path):
    save_word_tokenizer(tmp_path, 64)
    with pytest.raises(ValueError, match="chat template"):
        make_workload("chat-fixed", num_requests=2, model_dir=tmp_path)
    with pytest.raises(ValueError, match="chat tokenizer"):
        make_workload("chat-fixed", num_requests=2)


def test_take_passage_keeps_whole_paragraphs_within_the_target(chat_model):
    import random

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    topic = Topic("T", ["a" * 10, "b" * 20, "c" * 30, "d" * 40], [10, 20, 30, 40])
    for seed in range(20):
        passage = take_passage(topic, 55, random.Random(seed), tokenizer)
        parts = passage.split("\n\n")
        assert sum(map(len, parts)) <= 55 and "".join(parts) in "a" * 10 + "b" * 20 + "c" * 30
    long = Topic("L", ["word " * 100], [500])
    cut = take_passage(long, 42, random.Random(0), tokenizer)
    assert len(cut) <= 42 and cut.endswith("word")


def test_natural_lengths_end_at_the_first_stop_token():
    requests = [BenchRequest([1], 4), BenchRequest([1], 3)]
    check_lengths("x", [[5, 6, 2], [5, 6, 7]], requests, stop_token_ids=(2,))
    check_lengths("x", [[5, 6, 7, 8], [5, 6, 2]], requests, stop_token_ids=(2,))
    for bad in ([[5, 2, 6], [5, 6, 7]], [[5, 6], [5, 6, 7]], [[2, 5, 6, 7], [5, 6, 7]]):
        with pytest.raises(RuntimeError, match="end of the turn"):
            check_lengths("x", bad, requests, stop_token_ids=(2,))
    assert cut_at_stop([5, 2, 0, 0], (0, 2)) == [5, 2] and cut_at_stop([5, 6], (2,)) == [5, 6]


# ---- llama.cpp against a stand-in llama-server ---------------------------------------------

FAKE_SERVER = textwrap.dedent(
    """
    import json, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    argv = sys.argv[1:]
    log = open(argv[argv.index("--log") + 1], "a")
    log.write(json.dumps({"argv": argv}) + "\\n"); log.flush()
    health = {"calls": 0}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def reply(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            health["calls"] += 1  # "loading" once, as a real server answers 503 at first
            self.reply(200 if health["calls"] > 1 else 503, {"status": "ok"})

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            log.write(json.dumps({"request": req}) + "\\n"); log.flush()
            n = req["n_predict"]
            tokens = [7] * n if req["ignore_eos"] else [5] * min(2, n - 1) + [2]
            self.reply(200, {"tokens": tokens, "tokens_evaluated": len(req["prompt"]),
                             "truncated": False, "stop_type": "limit",
                             "timings": {"prompt_ms": 1.0, "predicted_ms": 2.0, "cache_n": 0}})

    port = int(argv[argv.index("--port") + 1])
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


def fake_llama_server(tmp_path: Path) -> tuple[Path, Path]:
    """A llama-server stand-in (logging its argv and requests) and a one-tensor F32 GGUF."""
    import gguf
    import numpy as np

    script, log = tmp_path / "fake_server.py", tmp_path / "server.jsonl"
    script.write_text(FAKE_SERVER)
    binary = tmp_path / "llama-server"
    binary.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@" --log {log}\n')
    binary.chmod(0o755)
    path = tmp_path / "tiny-F32.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tensor("x", np.zeros(4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return binary, path


def logged(log: Path) -> tuple[list[str], list[dict]]:
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    return lines[0]["argv"], [x["request"] for x in lines if "request" in x]


def test_llamacpp_system_fixed_lengths(tmp_path):
    binary, path = fake_llama_server(tmp_path)
    workload = make_workload("offline-mixed", num_requests=3)
    ctx = BenchContext(
        model_dir=tmp_path, workload=workload, dtype="float32", log=lambda m: None,
        llamacpp_server=binary, llamacpp_gguf_choice=str(path), llamacpp_parallel=8,
        warmup_requests=1,
    )  # fmt: skip
    system = LlamaCppSystem(ctx)
    try:
        result = system.run_pass()
        assert [len(t) for t in result.token_ids] == [r.max_tokens for r in workload.requests]
        assert system.info()["file_type"] == "ALL_F32"
    finally:
        system.close()
    assert system.server.proc.poll() is not None
    argv, requests = logged(tmp_path / "server.jsonl")
    flags = dict(zip(argv[::2], argv[1::2], strict=False))
    assert flags["-m"] == str(path) and flags["-np"] == "3" and flags["-t"] == "2"
    assert "-cb" in argv and "-kvu" in argv and "--cache-ram" in argv
    assert argv[argv.index("-ctk") + 1] == "f32" == argv[argv.index("-ctv") + 1]
    cells = int(argv[argv.index("-c") + 1])
    assert cells % 256 == 0 and cells >= workload.max_seq_len
    assert len(requests) == 1 + 3  # the warm-up, then the pass
    wanted = [completion_payload(r, ignore_eos=True) for r in workload.requests]
    key = json.dumps  # sent all at once: the server may log them in any order
    assert sorted(map(key, requests[1:])) == sorted(map(key, wanted))
    for sent in requests[1:]:
        assert sent["temperature"] == 0 and sent["top_k"] == 1
        assert sent["return_tokens"] and not sent["cache_prompt"] and sent["ignore_eos"]


def test_llamacpp_system_natural_lengths_and_bad_answers(tmp_path, chat_model):
    binary, path = fake_llama_server(tmp_path)
    workload = make_workload("chat-natural", num_requests=2, model_dir=chat_model)
    ctx = BenchContext(
        model_dir=chat_model, workload=workload, dtype="float32", log=lambda m: None,
        llamacpp_server=binary, llamacpp_gguf_choice=str(path), warmup_requests=1,
    )  # fmt: skip
    system = LlamaCppSystem(ctx)
    try:
        assert system.run_pass().token_ids == [[5, 5, 2], [5, 5, 2]]
    finally:
        system.close()
    _, requests = logged(tmp_path / "server.jsonl")
    assert all(not r["ignore_eos"] and r["n_predict"] == 256 for r in requests)

    request = BenchRequest([1, 2, 3], 4)
    assert parse_completion({"tokens": [9, 9], "tokens_evaluated": 3}, request) == [9, 9]
    with pytest.raises(RuntimeError, match="BOS added"):
        parse_completion({"tokens": [9], "tokens_evaluated": 4}, request)
    with pytest.raises(RuntimeError, match="truncated"):
        parse_completion({"tokens": [9], "tokens_evaluated": 3, "truncated": True}, request)
    with pytest.raises(RuntimeError, match="llama-server"):
        parse_completion({"error": {"code": 500}}, request)


def test_offline_with_two_gguf_rows(tmp_path, chat_model, capsys):
    binary, path = fake_llama_server(tmp_path)
    out = tmp_path / "bench.json"
    argv = ["--model", str(chat_model), "--workload", "chat-fixed", "--num-requests", "2",
            "--systems", "llama.cpp", "--llamacpp-server", str(binary), "--llamacpp-gguf",
            f"{path},{path}", "--repeats", "2", "--no-roofline", "--warmup-requests", "1",
            "--json", str(out)]  # fmt: skip
    assert main(["offline", *argv]) == 0
    record = json.loads(out.read_text())
    medians = {m["system"]: m for m in record["medians"]}
    assert set(medians) == {"llama.cpp", f"llama.cpp-{path.name}"}
    workload = make_workload("chat-fixed", num_requests=2, model_dir=chat_model)
    assert medians["llama.cpp"]["output_tokens"] == workload.output_tokens
    assert "ALL_F32" in capsys.readouterr().out


def test_flags_and_presets(tmp_path, chat_model):
    assert "smollm2-135m" in MODEL_PRESETS
    with pytest.raises(SystemExit):
        main(["offline", "--systems", "jaxcb,llama.cpp"])  # no server given
    some = tmp_path / "x.gguf"
    some.write_bytes(b"GGUF")
    assert resolve_gguf(tmp_path, str(some)) == some
    with pytest.raises(ValueError, match="smollm2-135m's files"):
        resolve_gguf(tmp_path, "f32")
    with pytest.raises(ValueError, match="no such file"):
        resolve_gguf(tmp_path, str(tmp_path / "missing.gguf"))

    serving = load("serving")
    parser = command_parser("serving", serving)
    args = parser.parse_args(["--dataset-name", "chat", "--tokenizer", str(chat_model),
                              "--num-prompts", "3"])  # fmt: skip
    serving.check_args(parser, args)
    requests = serving.sample_requests(args)
    workload = make_workload("chat-fixed", num_requests=3, model_dir=chat_model)
    assert [r.prompt for r in requests] == [r.prompt_token_ids for r in workload.requests]
    assert [r.expected_output_len for r in requests] == [r.max_tokens for r in workload.requests]
    assert args.ignore_eos

    one = single_request(workload, 256)
    assert len(one.requests) == 1 and one.requests[0].max_tokens == 256 and one.ignore_eos
    assert one.requests[0].prompt_token_ids in [r.prompt_token_ids for r in workload.requests]
    rows = [{"n_prompt": 0, "n_gen": 256, "avg_ts": 125.0, "stddev_ts": 1.5}]
    assert parse_llama_bench(json.dumps(rows))["ms_per_token"] == pytest.approx(8.0)
    # paired turns: each pass's tok/s (decode, else wall) over the same round's llama-bench
    ratio = paired([(8.0, 7.0), (8.0, None), (4.0, 5.0)], [125.0, 100.0, 250.0])
    assert ratio == pytest.approx(dict(median=1000 / 7 / 125, min=0.8, max=1.25))
    assert paired([(8.0, 7.0)], []) is None
    # against the read limit: bytes a token reads x tok/s over the same round's bandwidth
    share = share_of_limit([100.0, 50.0, 80.0], [40e9, 10e9, 20e9], 200_000_000)
    assert share == pytest.approx(dict(median=0.8, min=0.5, max=1.0))
    assert share_of_limit([100.0], [], 200_000_000) is None
    with pytest.raises(SystemExit):  # --llama-bench needs a GGUF file to run
        main(["single_stream", "--systems", "jaxcb", "--llama-bench", str(tmp_path)])


def test_decode_weight_bytes_count_the_layers_matmuls_and_the_lm_head():
    """SmolLM2-135M's shapes: 30 layers of q, k, v, o (9 and 3 heads of 64) and gate, up,
    down (576 -> 1536), and the 49,152 x 576 LM head: 269.0 MB in bf16, twice that in f32."""
    from jaxcb.bench.roofline import decode_weight_bytes
    from jaxcb.models.loading.loader import spec_from_hf_config

    spec = spec_from_hf_config(
        dict(
            architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536,
            num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
            vocab_size=49152, max_position_embeddings=2048, rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        )
    )  # fmt: skip
    layer = 576 * 64 * (2 * 9 + 2 * 3) + 3 * 576 * 1536
    assert decode_weight_bytes(spec, 2) == 2 * (30 * layer + 49152 * 576) == 268_959_744
    assert decode_weight_bytes(spec, 4) == 2 * decode_weight_bytes(spec, 2)


@pytest.mark.skipif(not native.available(), reason="no native kernels here")
def test_read_limit_reads_the_buffer_on_one_thread_and_on_all():
    """The native read probe gives a bandwidth, on one thread and on every usable core (a
    figure, not a timing check: > 100 MB/s means it read the buffer and timed it)."""
    assert native.read_bandwidth(8 << 20, threads=1, passes=2) > 1e8
    assert native.read_bandwidth(8 << 20, passes=2) > 1e8


def test_profile_splits_each_step_by_kind(tmp_path, chat_model):
    """The profile benchmark on the tiny model: every step traced, its ops sorted into kinds
    (asked for async scheduling, as the SmolLM2 preset is, it times the steps one by one)."""
    out = tmp_path / "profile.json"
    config = REPO / "configs" / "tiny-cpu.yaml"
    argv = ["--model", str(chat_model), "--config", str(config), "--single"]
    argv += ["--async-scheduling", "true"]
    assert main(["profile", *argv, "--max-tokens", "6", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    decode, prefill = record["phases"]["decode"], record["phases"]["prefill"]
    assert decode["steps"] == 5 and prefill["steps"] == 1 and len(record["steps"]) == 6
    for phase in (decode, prefill):
        assert phase["matmul"] > 0 and phase["attention"] > 0 and phase["lm_head"] > 0
        assert phase["span"] <= phase["execute"] <= phase["step"]
        assert phase["executor"] >= 0  # the scan's while op is not counted over its body's
