"""vLLM's engine metric set under a `tokenline_` prefix, recorded through Ray's metrics (exported as `ray_tokenline_*`).

Names, meanings and buckets follow vLLM's Prometheus logger so its dashboards and alerts carry over.
"""
from __future__ import annotations

from engine.outputs import EngineStats, SchedulerStats
from engine.request import RequestTimings
from ray.util import metrics

from deployments.tenants import ANONYMOUS

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
TOKEN_LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
TAGS = ("model_name", "replica")
ENGINE_INFO_TAGS = ("attention_backend", "device", "dtype", "cuda_graphs")


def buckets_1_2_5(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to limit, as vLLM sizes its token-count histograms."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(float(m * scale))
        scale *= 10


class EngineMetrics:
    """One replica's metrics; gauges and counters follow EngineStats, histograms follow each finished request."""

    def __init__(self, model_name: str, replica: str, max_model_len: int) -> None:
        tags = {"model_name": model_name, "replica": replica}
        token_buckets = buckets_1_2_5(max_model_len)

        def gauge(name: str, doc: str) -> metrics.Gauge:
            g = metrics.Gauge(f"tokenline_{name}", doc, tag_keys=TAGS)
            g.set_default_tags(tags)
            return g

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> metrics.Counter:
            c = metrics.Counter(f"tokenline_{name}", doc, tag_keys=TAGS + extra)
            c.set_default_tags(tags)
            return c

        def histogram(name: str, doc: str, buckets: list[float]) -> metrics.Histogram:
            h = metrics.Histogram(f"tokenline_{name}", doc, boundaries=buckets, tag_keys=TAGS)
            h.set_default_tags(tags)
            return h

        self.num_requests_running = gauge("num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.num_requests_waiting_late = gauge(
            "num_requests_waiting_late", "Of the requests waiting, those past half the TTFT objective with no first "
                                         "token (engine.ttft_objective_s): queued behind those still on time.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_queries = counter("prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.num_preemptions = counter("num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.request_success = counter("request_success", "Count of successfully processed requests.",
                                       ("finished_reason",))
        self.iteration_tokens = histogram("iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                          ITERATION_TOKEN_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Number of generation tokens processed.", token_buckets)
        self.request_params_max_tokens = histogram("request_params_max_tokens",
                                                   "Histogram of the max_tokens request parameter.", token_buckets)
        self.request_params_n = histogram("request_params_n", "Histogram of the n request parameter.",
                                          [1, 2, 5, 10, 20])
        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Histogram of inter-token latency in seconds.", TOKEN_LATENCY_BUCKETS)
        self.time_per_output_token = histogram("request_time_per_output_token_seconds",
                                               "Histogram of time_per_output_token_seconds per request.",
                                               TOKEN_LATENCY_BUCKETS)
        self.e2e_latency = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                                     REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.",
                                        REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        # By tenant name (never a key): what each tenant's finished requests (one per choice) cost.
        self.tenant_requests = counter("tenant_requests", "Finished requests (choices) by tenant.", ("tenant",))
        self.tenant_prompt_tokens = counter("tenant_prompt_tokens", "Prompt tokens of finished requests by tenant.",
                                            ("tenant",))
        self.tenant_cached_tokens = counter("tenant_cached_tokens", "Prompt tokens served from the prefix cache, "
                                            "by tenant.", ("tenant",))
        self.tenant_output_tokens = counter("tenant_output_tokens", "Output tokens of finished requests by tenant.",
                                            ("tenant",))
        # Always 1; its labels say how the engine runs (as vLLM's cache_config_info).
        self.engine_info = metrics.Gauge("tokenline_engine_info", "How this engine replica runs: attention backend, "
                                         "device, dtype, CUDA graphs.", tag_keys=TAGS + ENGINE_INFO_TAGS)
        self.engine_info.set_default_tags(tags)
        self._info_tags: dict[str, str] | None = None
        self._last = EngineStats()
        self._last_step = 0

    def record_engine_info(self, attention_backend: str, device: str, dtype: str, cuda_graphs: bool) -> None:
        """Set again with every record_engine: Ray drops a gauge from its export once it stops being set."""
        self._info_tags = {"attention_backend": attention_backend, "device": device, "dtype": dtype,
                           "cuda_graphs": str(cuda_graphs).lower()}
        self.engine_info.set(1, tags=self._info_tags)

    def record_engine(self, stats: EngineStats, steps: list[SchedulerStats]) -> None:
        """Gauges from the current stats, counters from their growth since the previous call."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.num_requests_waiting_late.set(stats.num_waiting_late)
        self.kv_cache_usage.set(stats.kv_usage)
        if self._info_tags is not None:
            self.engine_info.set(1, tags=self._info_tags)
        last = self._last
        for counter, now, before in (
                (self.prefix_cache_queries, stats.prefix_cache_queries, last.prefix_cache_queries),
                (self.prefix_cache_hits, stats.prefix_cache_hits, last.prefix_cache_hits),
                (self.num_preemptions, stats.num_preemptions, last.num_preemptions),
                (self.prompt_tokens, stats.num_prompt_tokens, last.num_prompt_tokens),
                (self.generation_tokens, stats.num_generation_tokens, last.num_generation_tokens)):
            if now > before:
                counter.inc(now - before)
        self._last = stats
        for step in steps:
            if step.step > self._last_step:
                self.iteration_tokens.observe(step.num_prefill_tokens + step.num_decode_tokens)
                self._last_step = step.step

    def record_arrival(self, n: int, max_tokens: int) -> None:
        self.request_params_n.observe(n)
        self.request_params_max_tokens.observe(max_tokens)

    def record_first_token(self, ttft_s: float) -> None:
        self.time_to_first_token.observe(max(ttft_s, 0.0))

    def record_token_gap(self, gap_s: float, num_tokens: int) -> None:
        """Tokens that arrive together share the gap since the previous arrival."""
        per_token = gap_s / num_tokens
        for _ in range(num_tokens):
            self.inter_token_latency.observe(per_token)

    def record_tenant_usage(self, tenant: str, num_prompt_tokens: int, num_cached_tokens: int,
                            num_output_tokens: int) -> None:
        tags = {"tenant": tenant or ANONYMOUS}
        self.tenant_requests.inc(tags=tags)
        for counter, value in ((self.tenant_prompt_tokens, num_prompt_tokens),
                               (self.tenant_cached_tokens, num_cached_tokens),
                               (self.tenant_output_tokens, num_output_tokens)):
            if value > 0:
                counter.inc(value, tags=tags)

    def record_finished(self, finish_reason: str, num_prompt_tokens: int, num_output_tokens: int,
                        timings: RequestTimings | None) -> None:
        self.request_success.inc(tags={"finished_reason": finish_reason})
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_output_tokens)
        if timings is None or timings.first_token is None:
            return
        end = timings.finished or timings.last_token or timings.first_token
        self.e2e_latency.observe(max(end - timings.arrival, 0.0))
        last = timings.last_token or timings.first_token
        if num_output_tokens > 1:
            self.time_per_output_token.observe((last - timings.first_token) / (num_output_tokens - 1))
        self.decode_time.observe(max(last - timings.first_token, 0.0))
        if timings.first_scheduled is not None:
            self.queue_time.observe(max(timings.first_scheduled - (timings.queued or timings.arrival), 0.0))
            self.prefill_time.observe(max(timings.first_token - timings.first_scheduled, 0.0))
            self.inference_time.observe(max(last - timings.first_scheduled, 0.0))
