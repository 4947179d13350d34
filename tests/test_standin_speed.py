"""The stand-in's speed model (``miles_sglang_plugin/standin/speed.py``): the documented formulas, real waits
that a client measures, admission, streaming pace, and the timing it reports in ``meta_info``.

The pacer's times are told in its event loop's clock, so most of these run on a loop whose clock only moves
when everything waits (:mod:`tests.virtual_time`): they take no time, and what they measure is exactly what the
model says, whatever the machine's load. One test runs on the real clock: the waits really happen (a lower
bound, which sleeping guarantees)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from miles_sglang_plugin.standin.engine import build_app, main
from miles_sglang_plugin.standin.flags import parse_launch_argv
from miles_sglang_plugin.standin.speed import SPEED_ENV, Pacer, SpeedModel, speed_from_env
from tests.virtual_time import run_in_virtual_time

#: Exact up to floating-point rounding (the virtual clock adds up the waits).
EXACT = 1e-12


def test_step_and_prefill_times_follow_the_documented_formulas() -> None:
    model = SpeedModel()  # 20 ms step, 0.5 ms per sequence, 1 ms per extra TP rank, 20k prefill tok/s/GPU
    # (0.020 + 8 * 0.0005) / 4 + 0.001 * 3 = 0.006 + 0.003
    assert model.step_s(8, tp=4) == pytest.approx(0.009)
    # (0.020 + 16 * 0.0005) / 8 + 0.001 * 7 = 0.0035 + 0.007
    assert model.step_s(16, tp=8) == pytest.approx(0.0105)
    assert model.step_s(1, tp=1) == pytest.approx(0.0205)
    # 0.002 + 128 / (20000 * 2)
    assert model.prefill_s(128, tp=2) == pytest.approx(0.0052)


def test_speed_env_is_parsed_and_checked() -> None:
    assert speed_from_env({}) is None
    assert speed_from_env({SPEED_ENV: '{"decode_step_s": 0.01}'}) == SpeedModel(decode_step_s=0.01)
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['step'\]"):
        speed_from_env({SPEED_ENV: '{"step": 1}'})
    with pytest.raises(ValueError, match="latency_s must be a finite number >= 0"):
        speed_from_env({SPEED_ENV: '{"latency_s": -1}'})
    with pytest.raises(ValueError, match="prefill_tokens_per_s must be a finite number"):
        speed_from_env({SPEED_ENV: '{"prefill_tokens_per_s": 0}'})
    with pytest.raises(ValueError, match="must be a JSON object"):
        speed_from_env({SPEED_ENV: "[1]"})


def test_the_schemas_speed_settings_are_the_stand_ins_parameters() -> None:
    """The stand-in stays apart (it imports no config), so ``sglang_deploy.standin.speed`` declares the same
    parameters again: same names, same defaults (an 8B model on one GPU: 2 ms, 20k tok/s, 20 ms, 0.5 ms, 1 ms)."""
    from dataclasses import fields

    from miles_sglang_plugin.config.schema import StandInSpeedConf

    expected = {
        "latency_s": 0.002,
        "prefill_tokens_per_s": 20000.0,
        "decode_step_s": 0.020,
        "decode_token_s": 0.0005,
        "tp_comm_s": 0.001,
    }
    assert {f.name: f.default for f in fields(SpeedModel)} == expected
    assert {f.name: f.default for f in fields(StandInSpeedConf) if f.name != "enabled"} == expected


def test_a_bad_speed_variable_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model-path", "m", "--port", "1"], env={SPEED_ENV: "{oops"}) == 2
    assert f"{SPEED_ENV} must be a JSON object" in capsys.readouterr().err


#: One 50 ms step whatever the batch at TP 1, 20 ms before the first token: easy to time by hand.
FLAT = SpeedModel(
    latency_s=0.02, prefill_tokens_per_s=1e9, decode_step_s=0.05, decode_token_s=0.0, tp_comm_s=0.0
)


def _elapsed() -> float:
    return asyncio.get_running_loop().time()


def test_one_request_waits_prefill_plus_one_step_per_further_token() -> None:
    async def scenario() -> tuple[float, Any]:
        pacer = Pacer(FLAT, tp=1, max_running=8)
        start = _elapsed()
        timing = await pacer.run(input_tokens=10, output_tokens=5)
        return _elapsed() - start, timing

    waited, timing = run_in_virtual_time(scenario())
    # 20 ms prefill (first token; 10 tokens at 1e9 tokens/s add 1e-8 s) + 4 steps of 50 ms
    assert timing.first_token_latency == pytest.approx(0.02 + 1e-8, abs=EXACT)
    assert timing.e2e_latency == waited == pytest.approx(0.22 + 1e-8, abs=EXACT)
    assert timing.queue_time == 0


def test_the_waits_are_real_on_the_real_clock() -> None:
    async def scenario() -> tuple[float, Any]:
        pacer = Pacer(FLAT, tp=1, max_running=8)
        start = time.perf_counter()
        timing = await pacer.run(input_tokens=10, output_tokens=5)
        return time.perf_counter() - start, timing

    wall, timing = asyncio.run(scenario())
    # At least 20 ms + 4 steps of 50 ms (how much more depends on the machine's load: no upper bound)
    assert wall >= timing.e2e_latency >= 0.22 and timing.first_token_latency >= 0.02


def test_a_full_engine_queues_requests_first_come_first_served() -> None:
    async def scenario() -> list[Any]:
        pacer = Pacer(FLAT, tp=1, max_running=1)
        return list(await asyncio.gather(pacer.run(1, 3), pacer.run(1, 3)))

    first, second = run_in_virtual_time(scenario())
    # each: 20 ms (and 1 token at 1e9 tokens/s: 1e-9 s) + 2 steps = 120 ms; the second waits for the first's slot
    assert first.queue_time == 0 and first.e2e_latency == pytest.approx(0.12 + 1e-9, abs=EXACT)
    assert second.queue_time == pytest.approx(first.e2e_latency, abs=EXACT)
    assert second.e2e_latency == pytest.approx(0.24 + 2e-9, abs=EXACT)


def test_tp_makes_a_step_faster_and_batching_shares_it() -> None:
    model = SpeedModel(
        latency_s=0.0, prefill_tokens_per_s=1e9, decode_step_s=0.08, decode_token_s=0.0, tp_comm_s=0
    )

    async def scenario(tp: int, concurrent: int) -> float:
        pacer = Pacer(model, tp=tp, max_running=64)
        start = _elapsed()
        await asyncio.gather(*(pacer.run(1, 4) for _ in range(concurrent)))
        return _elapsed() - start

    # 3 steps of 80 ms at TP 1, of 20 ms at TP 4 (1 token at 1e9 tokens/s per GPU: 1e-9 s of prefill, a
    # quarter of it at TP 4); 8 concurrent requests share each step
    assert run_in_virtual_time(scenario(1, 1)) == pytest.approx(0.24 + 1e-9, abs=EXACT)
    assert run_in_virtual_time(scenario(4, 1)) == pytest.approx(0.06 + 2.5e-10, abs=EXACT)
    assert run_in_virtual_time(scenario(4, 8)) == pytest.approx(0.06 + 2.5e-10, abs=EXACT)


def _app(tp: int, *, mode: str = "null", speed: SpeedModel | None = FLAT) -> Any:
    argv = ["--model-path", "m", "--tp-size", str(tp), "--disaggregation-mode", mode]
    if mode == "prefill":
        argv += ["--disaggregation-bootstrap-port", "8998"]
    return build_app(parse_launch_argv(argv), speed=speed)


async def _post(app: Any, body: dict[str, Any]) -> tuple[Any, float]:
    async with TestClient(TestServer(app)) as client:
        start = _elapsed()
        response = await client.post("/generate", json=body)
        return await response.json(), _elapsed() - start


def test_generate_waits_and_reports_its_timing_in_meta_info() -> None:
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}}
    out, waited = run_in_virtual_time(_post(_app(1), body))
    meta = out["meta_info"]
    assert meta["completion_tokens"] == 4 and meta["prompt_tokens"] == 3
    assert meta["first_token_latency"] == pytest.approx(0.02, abs=1e-6)  # the meta's 6 decimals
    assert meta["e2e_latency"] == pytest.approx(0.17, abs=1e-6)  # 20 ms + 3 steps of 50 ms
    assert meta["queue_time"] == 0 and waited == pytest.approx(0.17, abs=1e-6)  # the client waited as long


def test_without_a_speed_model_generate_does_not_wait() -> None:
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 64}}
    out, waited = run_in_virtual_time(_post(_app(1, speed=None), body))
    assert "first_token_latency" not in out["meta_info"] and waited == 0  # nothing waited for at all


def test_a_pd_prefill_engine_only_prefills() -> None:
    body = {
        "input_ids": [5, 6, 7],
        "sampling_params": {"max_new_tokens": 8},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": 8998,
        "bootstrap_room": 1,
    }
    out, waited = run_in_virtual_time(_post(_app(1, mode="prefill"), body))
    # its 20 ms prefill, no decode step (8 tokens decoded would be 20 ms + 7 steps of 50 ms)
    assert out["meta_info"]["e2e_latency"] == pytest.approx(0.02, abs=1e-6)
    assert waited == pytest.approx(0.02, abs=1e-6)


def test_a_stream_sends_each_token_when_it_is_produced() -> None:
    async def scenario() -> list[tuple[float, dict[str, Any]]]:
        async with TestClient(TestServer(_app(1))) as client:
            start = _elapsed()
            body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}, "stream": True}
            response = await client.post("/generate", json=body)
            events = []
            async for line in response.content:
                text = line.decode().strip()
                if text.startswith("data: {"):
                    events.append((_elapsed() - start, json.loads(text[6:])))
            return events

    events = run_in_virtual_time(scenario())
    assert [len(e["output_ids"]) for _, e in events] == [1, 2, 3]
    # token 1 after the 20 ms prefill, then one per 50 ms step
    assert [t for t, _ in events] == pytest.approx([0.02, 0.07, 0.12], abs=1e-6)
    assert events[-1][1]["meta_info"]["first_token_latency"] == pytest.approx(0.02, abs=1e-6)
