"""Mixture-of-experts speed on this machine: one MoE FFN layer against a dense FFN of the same
active parameters, and end-to-end offline generation, jaxcb against transformers.

The model is Mixtral-like with random weights (--hidden 512, --experts 8, --top-k 2,
--intermediate 1024 per expert, --layers 4; float32 or --dtype bfloat16).

  (1) FFN layer   models/moe.py's sparse_mlp (router, sort by expert, grouped SwiGLU and
                  grouped down projection through packed.grouped_swiglu / grouped_matmul)
                  against sublayers.py's dense mlp of intermediate k * I (the same weights a
                  token multiplies by), at --tokens 1,16,128,512, both prepared as the engine
                  prepares them (cpu_params.prepare_cpu_params: the dense weights packed for
                  the native matmul kernel --kernel picks; the experts as that code handles
                  them). Median ms of --repeats calls, and the ratio MoE / dense.
  (2) end to end  --num-prompts token-id prompts of --prompt-len tokens, greedy, EOS ignored,
                  --max-tokens each: jaxcb's LLM.generate (one offline batch; compiling is
                  done when the engine is built and never timed) against transformers'
                  model.generate on the whole batch (equal-length prompts: no padding), after
                  an untimed warm-up each. Output tok/s = num_prompts x max_tokens / wall; with
                  float32 it also counts the requests whose tokens equal transformers'.

On CPU, XLA lowers jax.lax.ragged_dot densely (every row times every expert, masked: about
E times the arithmetic of the rows' own experts), so without a native grouped kernel behind
packed.grouped_matmul the MoE layer costs about E / k times the dense one; where the experts
are packed for the native grouped kernel, part (1) also times the same layer through
ragged_dot (plain arrays), for comparison. The machine is
shared and noisy: compare the ratios of one run. --json writes both parts' figures.

    python -m jaxcb.bench moe                          # both parts, float32
    python -m jaxcb.bench moe --dtype bfloat16 --skip-e2e
    python -m jaxcb.bench moe --skip-ffn --num-prompts 16 --max-tokens 32
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb import LLM, SamplingParams
from jaxcb.bench.commands import SharedFlags
from jaxcb.bench.timing import median_seconds
from jaxcb.models import moe
from jaxcb.models.base import ParamInfo
from jaxcb.models.cpu_params import matmul_backend, prepare_cpu_params
from jaxcb.models.sublayers import mlp

DESCRIPTION = "a mixture of experts: one FFN layer against a dense one, and jaxcb vs transformers"
FLAGS = SharedFlags(
    repeats=20,
    repeats_help="timed calls per point of (1)",
    repeats_alias="--iters",
    dtype="float32",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model (Mixtral-like, random weights)")
    model.add_argument("--hidden", type=int, default=512, help="hidden size (%(default)s)")
    model.add_argument("--experts", type=int, default=8, help="experts (%(default)s)")
    model.add_argument("--top-k", type=int, default=2, help="experts per token (%(default)s)")
    model.add_argument(
        "--intermediate", type=int, default=1024, help="each expert's FFN size (%(default)s)"
    )
    model.add_argument("--layers", type=int, default=4, help="decoder layers (%(default)s)")
    model.add_argument("--heads", type=int, default=8, help="query heads (%(default)s)")
    model.add_argument("--kv-heads", type=int, default=4, help="KV heads (%(default)s)")
    model.add_argument("--vocab", type=int, default=4096, help="vocabulary (%(default)s)")
    ffn = parser.add_argument_group("(1) FFN layer")
    ffn.add_argument("--tokens", default="1,16,128,512", help="comma list of token counts")
    ffn.add_argument(
        "--kernel",
        default="auto",
        help="kernels.matmul, for (1)'s packing and (2)'s engine: auto, xla or a kernel name",
    )
    ffn.add_argument("--skip-ffn", action="store_true", help="skip part (1)")
    e2e = parser.add_argument_group("(2) end to end")
    e2e.add_argument("--num-prompts", type=int, default=32, help="requests (%(default)s)")
    e2e.add_argument("--prompt-len", type=int, default=32, help="tokens each (%(default)s)")
    e2e.add_argument("--max-tokens", type=int, default=64, help="output tokens (%(default)s)")
    e2e.add_argument("--max-num-batched-tokens", type=int, default=256, help="jaxcb's step budget")
    e2e.add_argument("--torch-threads", type=int, help="torch.set_num_threads (torch's choice)")
    e2e.add_argument("--model-dir", type=Path, help="where to save the model (a temp dir)")
    e2e.add_argument("--skip-e2e", action="store_true", help="skip part (2)")
    parser.add_argument("--seed", type=int, default=0)


def mixtral_config(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
    )


# ---- (1) one FFN layer ------------------------------------------------------------------


def ffn_layers(args: argparse.Namespace, dtype: Any, kernel: str) -> tuple[Any, dict, dict, dict]:
    """The spec, one sparse layer and one dense layer of k * I, prepared as the engine does,
    and the sparse layer unprepared (plain arrays: ragged_dot)."""
    spec = moe.spec_from_hf_config(mixtral_config(args), "MixtralForCausalLM")
    rng = np.random.default_rng(args.seed)
    sparse_infos = {
        k: v
        for k, v in moe.param_infos(spec)["layers"][0].items()
        if k in ("router", "w_experts_gate_up", "w_experts_down")
    }
    h, wide = args.hidden, args.top_k * args.intermediate
    dense_infos = {
        "w_gate_up": ParamInfo((h, 2, wide), ("embed", "gate_up", "mlp"), True),
        "w_down": ParamInfo((wide, h), ("mlp", "embed"), True),
    }

    def random(info: ParamInfo) -> np.ndarray:
        scale = info.shape[-3 if len(info.shape) == 4 else -2] ** -0.5  # fan-in
        return (rng.standard_normal(info.shape, np.float32) * scale).astype(dtype)

    infos = {
        "embed": ParamInfo((8, h), ("vocab", "embed")),  # (prepare_cpu_params wants them)
        "lm_head": ParamInfo((h, 8), ("embed", "vocab"), True),
        "layers": [sparse_infos, dense_infos],
    }
    params = jax.tree_util.tree_map(random, infos, is_leaf=lambda x: isinstance(x, ParamInfo))
    plain = jax.tree_util.tree_map(jnp.asarray, params["layers"][0])
    pack = None if kernel == "xla" else kernel
    params, _ = prepare_cpu_params(params, infos, pack=pack, greedy_screen=False)
    sparse, dense = jax.tree_util.tree_map(jnp.asarray, params["layers"])
    return spec, sparse, dense, plain


def bench_ffn(args: argparse.Namespace, dtype: Any) -> list[dict[str, Any]]:
    """Part (1): a row per --tokens count (milliseconds), printed and returned."""
    kernel = matmul_backend(args.kernel, dtype=dtype, tensor_parallel_size=1)
    spec, sparse, dense, plain = ffn_layers(args, dtype, kernel)
    packed = isinstance(sparse["w_experts_down"], dict)
    moe_fn = jax.jit(lambda layer, x, n: moe.sparse_mlp(layer, x, spec, n))
    dense_fn = jax.jit(mlp)
    e, k, i = args.experts, args.top_k, args.intermediate
    print(
        f"\n(1) one FFN layer, H={args.hidden}: {e} experts top-{k} of I={i} against dense "
        f"I={k * i} ({args.dtype}, matmul kernel {kernel}; median of {args.repeats} calls)"
    )
    print(f"experts: {'packed for the native grouped kernel' if packed else 'plain arrays'}")
    header = f"{'tokens':>6} {'moe ms':>9} {'dense ms':>9} {'moe/dense':>10}"
    print(header + (f" {'ragged_dot ms':>14} {'ragged/dense':>13}" if packed else ""))
    rng = np.random.default_rng(args.seed + 1)
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = jnp.asarray(rng.standard_normal((tokens, args.hidden)), jnp.float32)
        n = jnp.int32(tokens)
        t_moe = median_seconds(moe_fn, (sparse, x, n), args.repeats)
        t_dense = median_seconds(dense_fn, (dense, x, n), args.repeats)
        rows.append(dict(tokens=tokens, kernel=kernel, moe_ms=t_moe * 1e3, dense_ms=t_dense * 1e3))
        line = f"{tokens:>6} {t_moe * 1e3:>9.3f} {t_dense * 1e3:>9.3f} {t_moe / t_dense:>10.2f}"
        if packed:  # the same layer through XLA's ragged_dot, as without the native kernel
            t_ragged = median_seconds(moe_fn, (plain, x, n), max(3, args.repeats // 4))
            rows[-1]["ragged_dot_ms"] = t_ragged * 1e3
            line += f" {t_ragged * 1e3:>14.3f} {t_ragged / t_dense:>13.2f}"
        print(line, flush=True)
    return rows


# ---- (2) end to end ---------------------------------------------------------------------


def write_model(args: argparse.Namespace, path: Path) -> Any:
    """A random-weight Mixtral saved by transformers; returns the torch model."""
    import torch
    import transformers

    cfg = {k: v for k, v in mixtral_config(args).items() if k != "architectures"}
    cfg.pop("model_type")
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.MixtralConfig(**cfg, initializer_range=0.1)
    ).eval()
    if args.dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(path)
    return model


def bench_e2e(args: argparse.Namespace) -> dict[str, Any]:
    """Part (2): jaxcb's and transformers' wall seconds and output tok/s, printed and returned."""
    import torch

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    n, p, m = args.num_prompts, args.prompt_len, args.max_tokens
    rng = np.random.default_rng(args.seed + 2)
    prompts = rng.integers(3, args.vocab, size=(n, p)).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model_dir or Path(tmp)
        model = write_model(args, path)
        pages_per_seq = -(-(p + m) // 16)
        llm = LLM(
            path,
            dtype=args.dtype,
            matmul=args.kernel,
            max_num_seqs=n,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=pages_per_seq * 16,
            page_size=16,
            num_pages=n * pages_per_seq + 16,
        )
        greedy = SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        t_jaxcb = time.perf_counter() - start

        ids = torch.tensor(prompts)
        kw = dict(do_sample=False, pad_token_id=0)
        with torch.no_grad():
            model.generate(ids[:2], attention_mask=torch.ones_like(ids[:2]), max_new_tokens=4, **kw)
            start = time.perf_counter()
            ref = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=m, min_new_tokens=m, **kw
            )
            t_hf = time.perf_counter() - start
    same = sum(o.token_ids == r[p:].tolist() for o, r in zip(outs, ref, strict=True))
    info = llm.engine.info
    print(
        f"\n(2) end to end: {n} prompts of {p} tokens, {m} greedy output tokens each "
        f"({args.dtype}, {args.layers} layers; jaxcb: matmul {info.matmul_backend}, attention "
        f"{info.attention_backend}, compiled in {info.compile_seconds:.0f} s, untimed)"
    )
    print(f"{'system':>14} {'wall s':>8} {'output tok/s':>13}")
    for name, seconds in (("jaxcb", t_jaxcb), ("transformers", t_hf)):
        print(f"{name:>14} {seconds:>8.2f} {n * m / seconds:>13.1f}")
    print(f"jaxcb / transformers: {t_hf / t_jaxcb:.2f}x output tok/s")
    if args.dtype == "float32":
        print(f"requests with tokens equal to transformers': {same} of {n}")
    return dict(
        jaxcb=dict(
            wall_s=t_jaxcb,
            output_tok_s=n * m / t_jaxcb,
            matmul=info.matmul_backend,
            attention=info.attention_backend,
            compile_seconds=info.compile_seconds,
        ),
        transformers=dict(wall_s=t_hf, output_tok_s=n * m / t_hf),
        same_tokens=same if args.dtype == "float32" else None,
        num_prompts=n,
    )


def run(args: argparse.Namespace, record: dict[str, Any]) -> None:
    print(f"jax {jax.__version__} on {jax.default_backend()}")
    if not args.skip_ffn:
        record["ffn"] = bench_ffn(args, jnp.dtype(args.dtype))
    if not args.skip_e2e:
        record["end_to_end"] = bench_e2e(args)
