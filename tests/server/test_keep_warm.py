"""scheduler.keep_warm_seconds: an idle server runs empty steps for a while after its last
real one, and they change nothing a client or the stats can see."""

from __future__ import annotations

import dataclasses
import time

from starlette.testclient import TestClient

from jaxcb import SamplingParams
from jaxcb.server import ServerSettings, build_app

BODY = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def test_keep_warm_steps_while_recently_active_and_change_nothing(reference_llm, monkeypatch):
    engine = reference_llm.engine
    expected = (
        reference_llm.generate(
            [[5, 6, 7, 8]],
            SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    config = engine.config
    warm_config = dataclasses.replace(
        config, scheduler=dataclasses.replace(config.scheduler, keep_warm_seconds=0.5)
    )
    monkeypatch.setattr(engine, "config", warm_config)
    calls = []
    real = engine.keep_warm
    monkeypatch.setattr(engine, "keep_warm", lambda: (calls.append(time.monotonic()), real()))

    app = build_app(engine, ServerSettings(served_model_names=("tiny",)))
    with TestClient(app) as client:
        time.sleep(0.2)
        assert calls == []  # nothing ran yet: no warmth to keep
        steps_before = engine.stats()["steps"]
        first = client.post("/v1/completions", json={**BODY, "prompt": [5, 6, 7, 8]}).json()
        done = time.monotonic()
        steps_after = engine.stats()["steps"]
        time.sleep(1.0)  # the keep-warm window (0.5 s) passes
        assert calls and all(t - done < 0.5 + 0.2 for t in calls)
        assert len(calls) <= 0.5 / 0.02 + 2
        assert engine.stats()["steps"] == steps_after > steps_before  # empty steps not counted
        engine.check_page_invariant()
        second = client.post("/v1/completions", json={**BODY, "prompt": [5, 6, 7, 8]}).json()
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    assert first["usage"]["completion_tokens"] == len(expected) == 8
    assert engine.pool.num_used == 0


def test_keep_warm_seconds_must_not_be_negative():
    import pytest

    from jaxcb.config import SchedulerConfig

    with pytest.raises(ValueError, match="keep_warm_seconds must be >= 0"):
        SchedulerConfig(keep_warm_seconds=-1.0)
