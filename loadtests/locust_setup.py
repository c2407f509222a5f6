"""Locust command-line options of our users and shapes, the shared prompt source, and the exact-records file.

Everything heavy (tokenizer, prompts) is built once per process at Locust's `init` event, before any user runs,
so building prompts never stalls the gevent loop mid-test.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import gevent
from locust import events

from loadtests.datasets import MOONCAKE_BLOCK_SIZE, TraceConfig
from loadtests.export import record_line
from loadtests.inputs import InputConfig, PromptCycle, build_specs
from loadtests.metrics import RecordMetrics
from loadtests.prompts import PromptBuilder
from loadtests.records import RequestRecord
from loadtests.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


@events.init_command_line_parser.add_listener
def add_options(parser: Any) -> None:
    g = parser.add_argument_group("tokenline load test")
    g.add_argument("--model", default="", help="model name (default: the first one /v1/models lists)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""), help="bearer token")
    g.add_argument("--prompt-source", choices=("synthetic", "trace"), default="synthetic")
    g.add_argument("--isl", type=int, default=128, help="synthetic: input tokens, mean")
    g.add_argument("--isl-std", type=float, default=0.0, help="synthetic: input tokens, stddev")
    g.add_argument("--osl", type=int, default=64, help="output tokens (max_tokens), mean")
    g.add_argument("--osl-std", type=float, default=0.0, help="output tokens, stddev")
    g.add_argument("--prompt-pool", type=int, default=128, help="synthetic prompts built up front and cycled")
    g.add_argument("--trace-file", default="", help="Mooncake trace for --prompt-source trace (timestamps unused: "
                                                    "Locust's users and shapes set the load)")
    g.add_argument("--trace-requests", type=int, default=0, help="first N trace rows (0: all)")
    g.add_argument("--block-size", type=int, default=MOONCAKE_BLOCK_SIZE, help="tokens per trace hash id")
    g.add_argument("--max-output-tokens", type=int, default=0, help="cap on trace output lengths (0: none)")
    g.add_argument("--tokenizer", default="", help="HF tokenizer folder or GGUF (default: the default model)")
    g.add_argument("--ignore-eos", action="store_true", default=False, help="send ignore_eos")
    g.add_argument("--records-jsonl", default="", help="write one exact record per request here")
    g.add_argument("--seed", type=int, default=-1, help="prompt seed (default: a new one each run, so no run finds "
                                                        "its prompts in the server's prefix cache)")
    g = parser.add_argument_group("tokenline load shapes (only with a shape file in -f)")
    g.add_argument("--shape-duration", type=float, default=60.0, help="seconds until the shape stops the test")
    g.add_argument("--step-users", type=int, default=2, help="step: users added per step")
    g.add_argument("--step-time", type=float, default=10.0, help="step: seconds per step")
    g.add_argument("--step-max-users", type=int, default=16, help="step: ceiling")
    g.add_argument("--spike-base-users", type=int, default=2, help="spike: users before and after")
    g.add_argument("--spike-users", type=int, default=16, help="spike: users during the spike")
    g.add_argument("--spike-start", type=float, default=20.0, help="spike: seconds into the test")
    g.add_argument("--spike-length", type=float, default=10.0, help="spike: seconds")


def build_source(options: Any) -> PromptCycle:
    if options.seed < 0:
        options.seed = secrets.randbelow(2**31)
    builder = PromptBuilder(load_tokenizer(options.tokenizer or None), options.seed)
    if options.prompt_source == "trace" and not options.trace_file:
        raise SystemExit("--prompt-source trace needs --trace-file")
    trace = TraceConfig(block_size=options.block_size, max_output_tokens=options.max_output_tokens or None)
    cfg = InputConfig("trace" if options.prompt_source == "trace" else "synthetic", options.isl, options.isl_std,
                      options.osl, options.osl_std, trace_path=Path(options.trace_file) if options.trace_file else None,
                      trace=trace, seed=options.seed)
    count = (options.trace_requests or None) if options.prompt_source == "trace" else options.prompt_pool
    specs = build_specs(builder, cfg, count)
    log.info("prompt source: %d %s prompts, seed %d", len(specs), options.prompt_source, options.seed)
    return PromptCycle(specs, builder)


@dataclass
class LoadTestState:
    source: PromptCycle | None = None
    records: TextIO | None = None

    def write(self, record: RequestRecord, metrics: RecordMetrics | None) -> None:
        if self.records is not None:
            self.records.write(json.dumps(record_line(record, metrics)) + "\n")
            self.records.flush()


STATE = LoadTestState()


@events.init.add_listener
def on_init(environment: Any, **_: Any) -> None:
    options = environment.parsed_options
    if options is None:
        return
    STATE.source = build_source(options)
    if options.records_jsonl:
        path = Path(options.records_jsonl)
        path.parent.mkdir(parents=True, exist_ok=True)
        STATE.records = open(path, "w", encoding="utf-8")
    # building took seconds without the gevent loop running: refresh its clock, or --run-time starts in the past
    gevent.get_hub().loop.update_now()


@events.quitting.add_listener
def on_quitting(**_: Any) -> None:
    if STATE.records is not None:
        STATE.records.close()
        STATE.records = None
