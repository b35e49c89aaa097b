"""LoRA adapters served as vLLM serves them: `--lora-modules` at start-up, the request's
`model` picking an adapter, `/v1/models` listing base and adapters, adapters loaded and
unloaded while serving (behind the API key, only with --allow-runtime-lora-updating), one
clear 4xx for a bad adapter that leaves the server serving, and the LoRA metrics."""

from __future__ import annotations

import json

import numpy as np
from server_helpers import ENGINE_ARGS, ENGINE_CONFIG, MODEL, metric, request, scrape

from jaxcb import LLM, LoRARequest, SamplingParams
from jaxcb.models.loading.default_model import CONFIG

KEY = "lora-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODULES = {  # module -> (in, out) of the built-in tiny model
    "q_proj": (128, 128),
    "k_proj": (128, 64),
    "v_proj": (128, 64),
    "o_proj": (128, 128),
    "gate_proj": (128, 384),
    "up_proj": (128, 384),
    "down_proj": (384, 128),
}
PROMPT = [5, 17, 99, 23, 61, 7]
BUCKETS = [16, 64]
BUCKET_ARGS = ["--token-buckets", *map(str, BUCKETS)]


def write_adapter(path, *, seed: int, rank: int = 4) -> str:
    """A random-weight PEFT adapter of the built-in tiny model, written without peft."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(CONFIG["num_hidden_layers"]):
        for module, (fan_in, fan_out) in MODULES.items():
            part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            name = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{name}.lora_A.weight"] = rng.normal(0, 0.3, (rank, fan_in)).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = rng.normal(0, 0.3, (fan_out, rank)).astype(
                np.float32
            )
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(MODULES),
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    return str(path)


def complete(url: str, model: str, headers=AUTH) -> tuple[int, dict]:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 0,
        "return_token_ids": True,
    }
    return request("POST", url + "/v1/completions", body, headers=headers)


def test_lora_adapters_served_loaded_and_unloaded(start_server, tmp_path):
    first = write_adapter(tmp_path / "first", seed=1)
    second = write_adapter(tmp_path / "second", seed=2)
    # (two buckets: the server and the reference engine compile little)
    lora_args = ["--enable-lora", "--max-loras", "1", "--max-lora-rank", "8", *BUCKET_ARGS]
    args = [*ENGINE_ARGS, *lora_args, "--lora-modules", f"first={first}", "--api-key", KEY]
    reference = LLM(
        **ENGINE_CONFIG, enable_lora=True, max_loras=1, max_lora_rank=8, token_buckets=BUCKETS
    )
    sp = SamplingParams(max_tokens=8, temperature=0.0)

    def expected(lora: LoRARequest | None) -> list[int]:
        out = reference.generate(PROMPT, sp, lora_request=lora, use_tqdm=False)
        return out[0].outputs[0].token_ids

    want_first = expected(LoRARequest("first", 1, first))
    want_second = expected(LoRARequest("second", 2, second))
    want_base = expected(None)
    assert len({tuple(want_first), tuple(want_second), tuple(want_base)}) == 3

    with start_server([*args, "--allow-runtime-lora-updating"]) as srv:
        status, listing = request("GET", srv.url + "/v1/models", headers=AUTH)
        assert status == 200
        assert [m["id"] for m in listing["data"]] == [MODEL, "first"]
        assert listing["data"][1]["parent"] == MODEL
        for model, want in [("first", want_first), (MODEL, want_base)]:
            status, body = complete(srv.url, model)
            assert status == 200, body
            assert body["model"] == model
            assert body["choices"][0]["token_ids"] == want

        status, body = complete(srv.url, "second")
        assert status == 404 and body["error"]["code"] == "model_not_found"

        load = srv.url + "/v1/load_lora_adapter"
        assert request("POST", load, {"lora_name": "second", "lora_path": second})[0] == 401
        status, _ = request("POST", load, {"lora_name": "second", "lora_path": second}, AUTH)
        assert status == 200
        status, body = complete(srv.url, "second")
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == want_second
        # one slot, two adapters: taking turns in it
        assert complete(srv.url, "first")[0] == 200 and complete(srv.url, "second")[0] == 200

        status, body = request("POST", load, {"lora_name": "second", "lora_path": second}, AUTH)
        assert status == 400 and "already been loaded" in body["error"]["message"]
        missing = str(tmp_path / "missing")
        status, body = request("POST", load, {"lora_name": "x", "lora_path": missing}, AUTH)
        assert status == 400 and "adapter_config.json" in body["error"]["message"]
        status, body = request("POST", load, {"lora_name": "x"}, AUTH)
        assert status == 400 and body["error"]["param"] == "lora_path"

        unload = srv.url + "/v1/unload_lora_adapter"
        assert request("POST", unload, {"lora_name": "second"}, AUTH)[0] == 200
        status, body = request("POST", unload, {"lora_name": "second"}, AUTH)
        assert status == 404
        assert complete(srv.url, "second")[0] == 404
        assert complete(srv.url, "first")[0] == 200  # still serving

        samples = scrape(srv.url)
        assert metric(samples, "jaxcb:lora_adapters", model_name=MODEL) == 1
        assert (
            metric(samples, "jaxcb:lora_requests_total", model_name=MODEL, lora_name="first") >= 3
        )
        assert metric(samples, "jaxcb:lora_slot_loads_total", model_name=MODEL) >= 3


def test_runtime_loading_needs_its_flag(server, tmp_path):
    """The shared server (no LoRA, no --allow-runtime-lora-updating) has no such route."""
    load = {"lora_name": "b", "lora_path": str(tmp_path)}
    assert request("POST", server.url + "/v1/load_lora_adapter", load)[0] == 404
