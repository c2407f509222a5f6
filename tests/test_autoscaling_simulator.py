"""The autoscaling simulator: deterministic for a seed, and its replica model predicts the real engine's throughput."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from autoscaling.foresight import ForesightPolicy
from autoscaling.policy import QueueKVConfig
from autoscaling.report import SLO, summarize
from autoscaling.serve_rules import ServeAutoscalingConfig
from autoscaling.simulator import ClusterConfig, OngoingRequestsPolicy, QueueKVSimPolicy, simulate
from autoscaling.replica import LATE_SHARE, SimReplica, SimRequest
from autoscaling.step_model import DEFAULT_PROFILE, EngineShape, ReplicaProfile, StepSample, StepTimeModel
from autoscaling.workload import (REPLICAS_OF_WORK, RequestSpec, ShapedWorkload, SyntheticWorkload, TraceWorkload,
                                saturation_rate, scaled_to)
from benchmarks.step_profile import serve_engine_settings
from engine.scheduler import LATE_SHARE as engine_late_share
from engine.scheduler import step_budget
from loadtests.datasets import MOONCAKE_TRACE

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ReplicaProfile.load(DEFAULT_PROFILE)
FAST_SERVE = ServeAutoscalingConfig(min_replicas=1, max_replicas=4, upscale_delay_s=5.0, downscale_delay_s=20.0,
                                    look_back_period_s=5.0, metrics_interval_s=1.0)


def single_replica() -> ClusterConfig:
    return ClusterConfig(serve=ServeAutoscalingConfig(min_replicas=1, max_replicas=1), initial_replicas=1)


def throughput(result) -> float:
    """Output tokens per second from the first arrival to the last token, as step_profile measures a run."""
    done = [r for r in result.requests if r.finish_s is not None]
    return sum(r.output_done for r in done) / max(r.last_token_s for r in done)


def surge(seed: int = 0) -> list[RequestSpec]:
    """Quiet, then 240 requests at 1.5 replicas' worth of load (on the recorded profile's replicas, whatever its
    speed), then quiet again."""
    quiet = SyntheticWorkload(20, rate=0.3, input_mean=200, input_std=50, output_mean=64, seed=seed).requests()
    lengths = dict(input_mean=300, input_std=100, output_mean=96, output_std=32, seed=seed + 1)
    one = saturation_rate(PROFILE.step_model, SyntheticWorkload(240, rate=1.0, **lengths).requests())
    busy = SyntheticWorkload(240, rate=1.5 * one, **lengths).requests()
    tail = SyntheticWorkload(30, rate=0.3, input_mean=200, input_std=50, output_mean=64, seed=seed + 2).requests()
    start_busy = quiet[-1].arrival_s
    start_tail = start_busy + busy[-1].arrival_s
    return (quiet + [dataclasses.replace(r, arrival_s=r.arrival_s + start_busy) for r in busy]
            + [dataclasses.replace(r, arrival_s=r.arrival_s + start_tail) for r in tail])


def test_same_seed_same_result_to_the_last_token():
    cluster = ClusterConfig(serve=FAST_SERVE, seed=7)
    runs = [simulate(surge(), PROFILE, QueueKVSimPolicy(), cluster) for _ in range(2)]
    assert [(r.first_token_s, r.finish_s, r.preemptions) for r in runs[0].requests] == \
           [(r.first_token_s, r.finish_s, r.preemptions) for r in runs[1].requests]
    assert runs[0].timeline == runs[1].timeline
    assert runs[0].replica_seconds == runs[1].replica_seconds


def test_queue_kv_policy_scales_out_for_a_surge_and_back_in_after_it():
    result = simulate(surge(), PROFILE, QueueKVSimPolicy(QueueKVConfig(scale_down_cooldown_s=10.0)),
                      ClusterConfig(serve=FAST_SERVE, startup_s=10.0))
    alive = [p.running + p.starting + p.draining for p in result.timeline]
    peak = alive.index(max(alive))
    assert max(alive) > 1, "the surge should need more than one replica"
    assert max(alive) <= FAST_SERVE.max_replicas
    assert alive[-1] < max(alive) and all(a >= FAST_SERVE.min_replicas for a in alive[peak:])
    assert all(r.finish_s is not None for r in result.requests), "draining replicas finish what they hold"
    assert result.replica_seconds < max(alive) * result.duration_s


def test_perfect_foresight_has_its_replicas_running_when_a_surge_arrives_and_lets_them_go_after():
    """ForesightPolicy (a bound for bench-autoscale) asks for replicas one lead time before the load needs them;
    a policy that only sees the load now has one replica when the surge lands."""
    requests = surge()
    start_busy = requests[20].arrival_s  # surge(): 20 quiet requests, then the busy minute
    cluster = ClusterConfig(serve=FAST_SERVE, startup_s=10.0)

    def running_at(result, t: float) -> int:
        return [p.running for p in result.timeline if p.t <= t][-1]

    foresight = simulate(requests, PROFILE, ForesightPolicy(requests, PROFILE, SLO(), cluster.startup_s), cluster)
    late = simulate(requests, PROFILE, QueueKVSimPolicy(), cluster)
    assert running_at(foresight, start_busy) >= 2 and running_at(late, start_busy) == 1
    assert running_at(foresight, start_busy - 30.0) == 1  # not asked for long before
    alive = [p.running + p.starting + p.draining for p in foresight.timeline]
    assert alive[-1] == 1 and max(alive) <= FAST_SERVE.max_replicas
    with pytest.raises(ValueError):
        ForesightPolicy(requests, PROFILE, SLO(), 10.0, headroom=1.0)


def test_a_replica_killed_at_its_drain_deadline_fails_what_it_held():
    serve = dataclasses.replace(FAST_SERVE, downscale_delay_s=0.0, upscale_delay_s=0.0)
    cluster = ClusterConfig(serve=serve, initial_replicas=2, graceful_shutdown_timeout_s=0.5)
    long_requests = [RequestSpec(0.0, 64, 2000)] * 2  # both keep their replicas busy long past the deadline
    result = simulate(long_requests, PROFILE, OngoingRequestsPolicy(target_ongoing_requests=8.0), cluster)
    assert sorted(r.failed or "ok" for r in result.requests) == ["killed", "ok"]


def test_the_recorded_profile_predicts_its_held_out_benchmark_run_within_25_percent():
    validation = PROFILE.validation
    requests = SyntheticWorkload(**validation["workload"]).requests()
    predicted = throughput(simulate(requests, PROFILE, OngoingRequestsPolicy(), single_replica()))
    measured = validation["measured"]["output_tok_s"]
    assert abs(predicted - measured) / measured < 0.25, (predicted, measured)


@pytest.mark.slow
def test_a_replica_fitted_on_a_real_engine_run_predicts_that_runs_throughput_within_25_percent(smollm2_path):
    """A small real run with queueing and preemption (16 running at most, a KV pool smaller than the load);
    the step model is fitted on its own steps, so what is checked is the simulated scheduler around it."""
    from benchmarks.step_profile import engine_shape, make_engine, run_workload

    engine = make_engine(str(smollm2_path), "bfloat16", threads=1, kv_cache_memory_bytes=0, num_kv_blocks=160,
                         max_num_batched_tokens=512, max_num_seqs=16)
    run_workload(engine, SyntheticWorkload(2, input_mean=32, output_mean=4).requests())  # warm-up
    workload = SyntheticWorkload(24, input_mean=200, input_std=60, output_mean=48, output_std=12, seed=3)
    record = run_workload(engine, workload.requests(), seed=3)
    assert record.num_preemptions > 0, "the load should overflow the KV pool"
    profile = ReplicaProfile("live", StepTimeModel.fit(record.samples, relative=False), engine_shape(engine))
    result = simulate(workload.requests(), profile, OngoingRequestsPolicy(), single_replica())
    predicted, measured = throughput(result), record.output_tok_s
    assert sum(r.preemptions for r in result.requests) > 0
    assert abs(predicted - measured) / measured < 0.25, (predicted, measured)


def test_step_model_fit_recovers_known_coefficients_and_ignores_contended_steps():
    truth = StepTimeModel(base=0.02, prefill_token=0.001, decode_seq=0.0005, context_token=2e-6,
                          prefill_attention=1.0)
    samples = []
    for i in range(200):
        prefill, decodes = (i * 37) % 1024 if i % 3 else 0, (i * 7) % 48
        sample = StepSample(prefill, decodes, decodes * (100 + i), prefill * (prefill / 2 + i) / 1e6, 0.0)
        slow = 3.0 if i % 10 == 0 else 1.0  # one step in ten lost its core to another process
        samples.append(dataclasses.replace(sample, seconds=truth.predict(sample) * slow))
    fitted = StepTimeModel.fit(samples, trim_slow=0.25)
    for name in ("base", "prefill_token", "decode_seq", "context_token"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.05), name


def test_a_mooncake_window_replays_with_shared_prefixes_served_from_cache():
    requests = TraceWorkload(str(MOONCAKE_TRACE), block_size=8, start_ms=975_400, end_ms=1_005_400,
                             max_output_tokens=64).requests()
    assert len(requests) > 100 and all(r.prefix_ids for r in requests)
    result = simulate(requests, PROFILE, QueueKVSimPolicy(), ClusterConfig(serve=FAST_SERVE))
    summary = summarize(result, SLO())
    assert summary.finished == len(requests)
    cached = sum(r.cached_tokens for r in result.requests) / sum(r.spec.prompt_tokens for r in result.requests)
    assert 0.1 < cached < 0.9, cached


def test_cli_compares_policies_and_writes_json_and_png(tmp_path):
    out = tmp_path / "sim.json"
    run = subprocess.run([sys.executable, "-m", "autoscaling.simulate", "--num-requests", "60", "--rate", "3",
                          "--policies", "queue_kv:waiting_high=3", "ongoing_requests:4", "--max-replicas", "3",
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    data = json.loads(out.read_text())
    assert [r["policy"] for r in data["results"]] == ["queue_kv:waiting_high=3", "ongoing_requests:4"]
    assert all(r["finished"] == 60 and r["replica_seconds"] > 0 for r in data["results"])
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_engine_shape_of_the_recorded_profile_is_the_apps():
    # serve_config.yaml as the SLO policy runs its engines: what `make step-profile` records
    app = serve_engine_settings()
    assert PROFILE.engine == EngineShape(block_size=16, num_kv_blocks=PROFILE.engine.num_kv_blocks,
                                         max_num_batched_tokens=app["max_num_batched_tokens"],
                                         max_num_seqs=app["max_num_seqs"],
                                         max_tokens_with_decodes=app.get("max_tokens_with_decodes"))
    assert PROFILE.engine.num_kv_blocks > 1000  # 512 MiB of KV, as serve_config.yaml gives each replica
    assert f"{app['threads']} torch thread(s)" in PROFILE.description


def test_the_slo_policy_runs_its_engines_with_the_step_budget_its_profile_was_recorded_with(tmp_path):
    from deployments.config import AppArgs

    slo = {"enabled": True, "policy": "slo"}
    assert PROFILE.engine.max_tokens_with_decodes == 160
    assert AppArgs(model="/m.gguf").engine_config().max_tokens_with_decodes is None
    assert AppArgs(model="/m.gguf", autoscaling=slo).engine_config().max_tokens_with_decodes == 160
    queue_kv = AppArgs(model="/m.gguf", autoscaling={**slo, "policy": "queue_kv"})
    assert queue_kv.engine_config().max_tokens_with_decodes is None
    explicit = AppArgs(model="/m.gguf", autoscaling=slo, engine={"max_tokens_with_decodes": 96})
    assert explicit.engine_config().max_tokens_with_decodes == 96
    other = tmp_path / "other.json"
    other.write_text(dataclasses.replace(PROFILE, engine=dataclasses.replace(PROFILE.engine,
                                                                             max_tokens_with_decodes=64)).to_json())
    own = AppArgs(model="/m.gguf", autoscaling={**slo, "slo": {"profile": str(other)}})
    assert own.engine_config().max_tokens_with_decodes == 64


def test_the_simulated_scheduler_keeps_a_step_beside_decodes_to_its_own_budget():
    """As engine/scheduler.py: a prompt at an idle replica takes the whole budget in one step; once requests
    decode, a step takes at most max_tokens_with_decodes (never fewer than its decodes)."""
    shape = EngineShape(block_size=16, num_kv_blocks=4096, max_num_batched_tokens=200, max_num_seqs=64,
                        max_tokens_with_decodes=48)
    replica = SimReplica(0, shape, PROFILE.step_model, started_at=0.0, ready_at=0.0)
    requests = [SimRequest(0, RequestSpec(0.0, 150, 40))]
    replica.add(requests[0], 0.0)
    now, steps = 0.0, []
    for i in range(1, 5):  # three more prompts join while the first decodes
        requests.append(SimRequest(i, RequestSpec(0.0, 120, 40)))
    for _ in range(200):
        if len(steps) == 2:
            for request in requests[1:]:
                replica.add(request, now)
        step = replica.start_step(now)
        if step is None:
            break
        steps.append(step)
        now += step.seconds
        replica.finish_step(now)
    assert all(r.finish_s is not None for r in requests)
    assert [n for _, n in steps[0].batch] == [150]  # alone: the whole prompt in one step
    later = steps[1:]
    decoding = [sum(1 for r, n in s.batch if n == 1 and r.computed > r.spec.prompt_tokens) for s in later]
    assert all(sum(n for _, n in s.batch) <= max(48, d) for s, d in zip(later, decoding))
    assert any(s.stats.num_prefill_tokens and s.stats.num_decode_requests for s in later)  # chunks beside decodes
    assert shape.budget(0) == 200 and shape.budget(10) == 48 and shape.budget(60) == 60
    assert dataclasses.replace(shape, max_tokens_with_decodes=None).budget(10) == 200
    for cap in (None, 48, 200, 300):  # the simulator's restatement of the engine's rule agrees with it
        restated = dataclasses.replace(shape, max_tokens_with_decodes=cap)
        assert all(restated.budget(d) == step_budget(200, cap, d) for d in (0, 1, 47, 48, 60, 199, 200, 250))


def test_a_lone_replica_offered_its_saturation_rate_keeps_up_below_it_and_falls_behind_above_it():
    """The synthetic workloads' rate is set in replicas' worth of work (autoscaling.workload.scaled_to): at the
    saturation rate the step model reads off the mix, one replica is busy all the time."""
    lengths = ShapedWorkload("steps", duration_s=600.0, rate=1.0, seed=5).requests()[:800]
    saturation = saturation_rate(PROFILE.step_model, lengths)

    def last_wait(share: float) -> float:
        gaps = np.random.default_rng(3).exponential(1 / (share * saturation), len(lengths))
        replay = [dataclasses.replace(r, arrival_s=float(t)) for r, t in zip(lengths, np.cumsum(gaps))]
        done = simulate(replay, PROFILE, OngoingRequestsPolicy(), single_replica()).requests[-100:]
        return float(np.median([r.first_token_s - r.spec.arrival_s for r in done]))

    assert last_wait(0.6) < 1.0  # keeps up: the last requests wait no longer than a few steps
    assert last_wait(1.2) > 20.0  # falls behind: the queue grew all along
    scaled = scaled_to(PROFILE.step_model, ShapedWorkload("bursts", seed=5))
    assert scaled.rate == pytest.approx(REPLICAS_OF_WORK * saturation, rel=0.1)


def test_busy_slowdown_stretches_the_steps_of_replicas_that_step_at_the_same_time_only():
    fixed = ClusterConfig(serve=ServeAutoscalingConfig(min_replicas=2, max_replicas=2), initial_replicas=2)
    slowed = dataclasses.replace(fixed, busy_slowdown=1.5)
    policy = OngoingRequestsPolicy(target_ongoing_requests=8.0)
    pair = [RequestSpec(0.0, 64, 200), RequestSpec(0.0, 64, 200)]  # one on each replica, decoding side by side
    alone = [RequestSpec(0.0, 64, 200)]
    finish = lambda result: max(r.finish_s for r in result.requests)  # noqa: E731
    assert finish(simulate(pair, PROFILE, policy, slowed)) == pytest.approx(
        1.5 * finish(simulate(pair, PROFILE, policy, fixed)), rel=0.02)
    assert finish(simulate(alone, PROFILE, policy, slowed)) == finish(simulate(alone, PROFILE, policy, fixed))


def test_validate_autoscale_fits_back_the_busy_slowdown_two_replicas_reported():
    from autoscaling.slo_policy import SLOConfig
    from benchmarks.validate_autoscale import PAIR_CALIBRATION, fit_busy_slowdown, pair_correction_of, workload

    config = SLOConfig()
    specs = workload(PROFILE, config, seed=3, phases=PAIR_CALIBRATION)
    reported = pair_correction_of(specs, PROFILE, config, busy_slowdown=1.5)
    assert 1.2 < reported < 1.5  # the two replicas' steps overlap most of the time, not always
    assert fit_busy_slowdown(specs, PROFILE, config, reported) == pytest.approx(1.5, abs=0.05)
    assert fit_busy_slowdown(specs, PROFILE, config, 0.9) == 1.0  # faster side by side: no slowdown


def test_validate_autoscale_sizes_the_busy_phase_to_what_two_calibrated_replicas_leave_room_for():
    from autoscaling.capacity import CapacityModel
    from autoscaling.slo_policy import SLOConfig
    from benchmarks.validate_autoscale import (BUSY, BUSY_MIN, BUSY_ROOM, PHASES, _sizes, busy_share, scaled,
                                               with_busy_share, workload)

    config = SLOConfig()
    assert busy_share(PROFILE, config, 5, 1.0, 1.0) == PHASES[BUSY][1]  # side by side as fast as alone: room enough
    assert busy_share(PROFILE, config, 5, 1.0, 3.0) == BUSY_MIN  # two barely beat one: still more than one's
    share = busy_share(PROFILE, config, 5, 1.6, 2.4)
    sizes = _sizes(5)
    alone = CapacityModel(scaled(PROFILE, 1.6), config.slo).capacity(sizes).alone_requests_per_s
    pair = 2 * CapacityModel(scaled(PROFILE, 2.4), config.slo).capacity(sizes).requests_per_s
    assert BUSY_MIN < share < PHASES[BUSY][1] and share * alone == pytest.approx(BUSY_ROOM * pair)
    assert busy_share(PROFILE, config, 5, 1.6, 2.2) > share  # less slowdown side by side, more load
    # Only the busy phase moves; the requests of the quiet phases stay as they were.
    phases = with_busy_share(share)
    assert phases[BUSY] == (PHASES[BUSY][0], share)
    assert all(phases[i] == PHASES[i] for i in range(len(PHASES)) if i != BUSY)
    before, after = workload(PROFILE, config, 5), workload(PROFILE, config, 5, phases)
    quiet = PHASES[0][0]
    assert [r for r in before if r.arrival_s < quiet] == [r for r in after if r.arrival_s < quiet]
    busy = lambda specs: sum(quiet <= r.arrival_s < quiet + PHASES[BUSY][0] for r in specs)  # noqa: E731
    assert busy(after) < busy(before)


def test_a_ttft_objective_spends_an_overloaded_replica_on_the_requests_that_can_still_meet_it():
    """As engine.tenancy.WaitingQueue: a waiting request past the objective with no first token goes behind those
    on time. Overload then costs the requests beyond the replica's capacity instead of every one queued behind
    them, and every request still finishes."""
    shape = EngineShape(block_size=16, num_kv_blocks=4096, max_num_batched_tokens=320, max_num_seqs=64)
    replica = SimReplica(0, shape, PROFILE.step_model, started_at=0.0, ready_at=0.0, ttft_objective_s=2.0)
    assert LATE_SHARE == engine_late_share  # the simulator restates the engine's rule
    late, fresh, started = (SimRequest(i, RequestSpec(t, 100, 8)) for i, t in enumerate((0.0, 9.5, 1.0)))
    started.output_done = 1  # preempted after its first token: never late
    for request in (late, fresh):
        replica.add(request, 0.0)
    assert replica._next_waiting(10.0) == 1 and replica._next_waiting(0.5) == 0  # late after half the objective
    replica.waiting.appendleft(started)
    assert replica._next_waiting(10.0) == 0
    replica.waiting.popleft()
    replica.waiting.remove(fresh)
    assert replica._next_waiting(10.0) == 0  # only late ones wait: the oldest goes
    assert SimReplica(0, shape, PROFILE.step_model, 0.0, 0.0)._next_waiting(10.0) == 0

    def burst_at(rate: float) -> list[RequestSpec]:
        return SyntheticWorkload(400, rate=rate, input_mean=240, input_std=60, output_mean=150, output_std=40,
                                 seed=3).requests()

    burst = burst_at(3 * saturation_rate(PROFILE.step_model, burst_at(1.0)))  # three replicas' worth on one
    end = burst[-1].arrival_s
    slo = SLO(ttft_s=2.0, itl_s=10.0, percentile=0.95)
    results = {objective: simulate(burst, PROFILE, OngoingRequestsPolicy(1e9),
                                   dataclasses.replace(single_replica(), ttft_objective_s=objective))
               for objective in (None, 2.0)}
    assert all(r.finish_s is not None for result in results.values() for r in result.requests)
    fifo, objective = (summarize(results[k], slo, 0.0, end + 1).attainment for k in (None, 2.0))
    assert objective > 2 * fifo and objective > 0.2, (fifo, objective)
