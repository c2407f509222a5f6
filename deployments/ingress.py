"""The OpenAI-compatible HTTP front (FastAPI through @serve.ingress): validate, template, tokenize, stream back.

The engine sees token ids only; text lives here, where each choice is detokenized incrementally. Templating and
tokenizing run on a worker thread, off the event loop that streams every other request. A request is checked
with the engine's own limits (engine.request_limits, as its replicas report them) before it is sent. An engine
replica that fails before the first token arrives costs the request one retry on another replica.
"""
# No `from __future__ import annotations`: FastAPI must see real types through Serve's rewritten signatures.
import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import ray
from fastapi import Depends, FastAPI, Query
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from ray.util import metrics

from deployments import auth, limits
from deployments import admin, timeline_recorder
from deployments.admin import ProfileReply
from deployments.auth import require_admin_key, require_api_key
from deployments.chat_template import render_chat
from deployments.config import AppArgs
from deployments.context import log_through_serve, replica_id
from deployments.detokenizer import IncrementalDetokenizer
from deployments.direct_ingress import direct_ingress_enabled, share_port_with_predecessor
from deployments.errors import OpenAIError, install_error_handlers
from deployments.generation import Generation, ReplicaLost
from deployments.http_metrics import HttpMetricsMiddleware
from deployments.limits import RequestLimitsMiddleware
from deployments.openai_format import (Echo, StreamUsage, TokenText, ToolParserFactory, chat_response, chat_stream,
                                       completion_response, completion_stream, json_response)
from deployments.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, NamedToolChoice,
                                  SamplingFields, TokenizeRequest)
from deployments.records import EngineRequest
from deployments.responses import DetokenizeResponse, ModelCard, ModelList, TokenizeResponse
from deployments.timeline import ROUTING_NOTES, TimelineView
from deployments.token_channel import ChannelledStream, ChannelServer
from deployments.tool_calls import NamedCallParser, ToolCallParser, forced_tool_output
from deployments.tenant_limits import TenantLimitsMiddleware, current_lease
from deployments.tenants import Tenant
from deployments.timeline_recorder import TimelineMiddleware, current_timeline
from engine.loader import load_tokenizer
from engine.outputs import ModelInfo
from engine.sampling_params import InvalidRequestError, StructuredOutput

log = logging.getLogger(__name__)

app = FastAPI(title="tokenline", docs_url=None, redoc_url=None)
install_error_handlers(app)
app.add_middleware(TenantLimitsMiddleware)  # innermost: tenants' limits once the server's own bounds passed
app.add_middleware(RequestLimitsMiddleware)
app.add_middleware(TimelineMiddleware)  # a request's timeline starts before the limits act on it
app.add_middleware(HttpMetricsMiddleware)  # added last, so outermost: it counts what the limits refuse

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
HEALTH_FRESH_S = 5.0  # an engine answer this recent makes /health answer without asking again
HEALTH_PROBE_TIMEOUT_S = 5.0
# Serve pickles the ingress class where it is declared: whatever it uses must be defined above it.


def _sse(events: Any) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _stream_usage(body: SamplingFields) -> StreamUsage:
    options = body.stream_options
    return StreamUsage(final=bool(options and options.include_usage),
                       continuous=bool(options and options.continuous_usage_stats))


def _tool_parser(choice: Any, parallel: bool) -> ToolParserFactory | None:
    """How the answer's tool calls are read: a named function's arguments, or the formats tool_calls.py reads."""
    if isinstance(choice, NamedToolChoice):
        return lambda: NamedCallParser(choice.function.name)
    if choice == "none":
        return None
    return lambda: ToolCallParser(parallel)


def _channel_counters() -> Callable[[int], None]:
    """Counts what the token channel carries, per ingress replica (messages: about one per engine step and engine
    replica; chunks: what Serve would otherwise have carried one by one)."""
    tags = {"replica": replica_id()}
    messages = metrics.Counter("tokenline_token_channel_messages",
                               "Messages read from engine replicas over the token channel.", tag_keys=("replica",))
    chunks = metrics.Counter("tokenline_token_channel_chunks",
                             "Request chunks carried by the token channel's messages.", tag_keys=("replica",))
    messages.set_default_tags(tags)
    chunks.set_default_tags(tags)

    def count(num_chunks: int) -> None:
        messages.inc()
        chunks.inc(num_chunks)

    return count


@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, engine: DeploymentHandle, args: AppArgs) -> None:
        log_through_serve()  # this replica's own records, and its router's, reach the replica log
        if direct_ingress_enabled():
            share_port_with_predecessor()
        self._engine = engine
        self._stream = engine.options(stream=True)  # configured once: each .options() builds a new handle
        self.model_name = args.model_name()
        self.model_path = args.model_path()
        self.tokenizer = load_tokenizer(self.model_path)
        self.tokens = TokenText(self.tokenizer)
        # One thread: a fast tokenizer shared by threads can fail ("Already borrowed") when they overlap.
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        # No token is longer than this many characters: a longer text cannot fit the context, untokenized.
        self.max_chars_per_token = max(map(len, self.tokenizer.get_vocab()), default=1)
        self._info: ModelInfo | None = None
        self._info_lock = asyncio.Lock()
        self._engine_answered_at = float("-inf")
        self._channel: ChannelServer | None = None
        self._channel_wanted = args.token_channel
        self._channel_lock = asyncio.Lock()
        auth.configure(args.security)
        limits.configure(args.limits)
        self.timelines = timeline_recorder.configure(args.timeline, self.model_name)
        self.profiler_dir = args.profiler_dir
        log.info("ingress ready for model %r (%s)", self.model_name, self.model_path)

    @app.get("/health")
    async def health(self) -> dict[str, str]:
        """200 while an engine replica answers: one did within HEALTH_FRESH_S, or does now."""
        if time.monotonic() - self._engine_answered_at > HEALTH_FRESH_S:
            try:
                self._info = await asyncio.wait_for(self._engine.model_info.remote(), HEALTH_PROBE_TIMEOUT_S)
            except Exception as exc:
                log.warning("health: no engine replica answered: %r", exc)
                raise OpenAIError(503, "no engine replica answers", code="engine_unavailable") from exc
            self._engine_answered_at = time.monotonic()
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=[Depends(require_api_key)])
    async def models(self) -> ModelList:
        return ModelList(data=[await self._model_card()])

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(require_api_key)])
    async def model(self, model_id: str) -> ModelCard:
        self._check_model(model_id)
        return await self._model_card()

    @app.post("/tokenize", dependencies=[Depends(require_api_key)])
    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        self._check_model(body.model)
        body.check_supported()
        if body.messages is not None:
            ids = await self._off_loop(self._render, body.messages, body.tools, body.add_generation_prompt)
        else:
            ids = await self._off_loop(functools.partial(self.tokenizer.encode, body.prompt,
                                                         add_special_tokens=body.add_special_tokens))
        info = await self._model_info()
        strs = [self.tokens(t) for t in ids] if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=info.limits.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize", dependencies=[Depends(require_api_key)])
    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self._check_model(body.model)
        info = await self._model_info()
        info.limits.check_token_ids("tokens", body.tokens)
        return DetokenizeResponse(prompt=await self._off_loop(self.tokenizer.decode, body.tokens))

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, tenant: Tenant = Depends(require_api_key)) -> Any:
        arrival = time.time()
        self._check_request(body)
        info = await self._model_info()
        prompts = []
        for prompt in body.prompts():
            if isinstance(prompt, str):
                self._check_text_fits(len(prompt), info)
                prompts.append(await self._off_loop(self.tokenizer.encode, prompt))
            else:
                if body.echo:
                    info.limits.check_token_ids("prompt", prompt)  # decoding an unknown id would fail
                prompts.append(list(prompt))
        want_logprobs = body.logprobs is not None
        echoes = [Echo(p if isinstance(p, str) else self.tokenizer.decode(ids), ids)
                  for p, ids in zip(body.prompts(), prompts)] if body.echo else None
        prompt_logprobs = body.logprobs if body.echo and want_logprobs else None
        request_id = f"cmpl-{uuid.uuid4().hex}"
        generation = await self._start(body, tenant, request_id, prompts, body.max_tokens, body.logprobs,
                                       COMPLETIONS_DEFAULT_MAX_TOKENS, arrival, prompt_logprobs=prompt_logprobs)
        if body.stream:
            return _sse(completion_stream(generation, request_id, self.model_name, echoes, body.n, self.tokens,
                                          want_logprobs, _stream_usage(body)))
        response = await completion_response(generation, request_id, self.model_name, echoes, body.n, self.tokens,
                                             want_logprobs)
        return json_response(response, generation)

    @app.post("/v1/chat/completions")
    async def chat(self, body: ChatCompletionRequest, tenant: Tenant = Depends(require_api_key)) -> Any:
        arrival = time.time()
        self._check_request(body)
        self._check_text_fits(sum(len(m.text()) for m in body.messages), await self._model_info())
        choice = body.effective_tool_choice
        prompt_ids = await self._off_loop(self._render, body.messages, body.tools if choice != "none" else None,
                                          body.add_generation_prompt)
        forced = forced_tool_output(body.tools or [], choice, body.parallel_tool_calls)
        if forced is not None and body.structured_output() is not None:
            raise OpenAIError(400, "tool_choice required or a named function cannot be combined with "
                                   "response_format or guided_* fields", "tool_choice")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        generation = await self._start(body, tenant, request_id, [prompt_ids], body.requested_max_tokens(),
                                       body.requested_logprobs(), None, arrival, structured=forced)
        tool_parser = _tool_parser(choice, body.parallel_tool_calls)
        if body.stream:
            return _sse(chat_stream(generation, request_id, self.model_name, self.tokens, body.logprobs,
                                    _stream_usage(body), tool_parser))
        response = await chat_response(generation, request_id, self.model_name, self.tokens, body.logprobs,
                                       tool_parser)
        return json_response(response, generation)

    @app.get("/v1/timelines/{request_id}", dependencies=[Depends(require_admin_key)])
    async def timeline(self, request_id: str) -> TimelineView:
        return self.timelines.lookup(request_id)

    @app.get("/debug/trace", dependencies=[Depends(require_admin_key)])
    async def trace(self, seconds: float = Query(10.0)) -> Any:
        return JSONResponse(await admin.trace(self._engine, self.timelines, seconds))

    @app.post("/start_profile", dependencies=[Depends(require_admin_key)])
    async def start_profile(self) -> ProfileReply:
        return await admin.start_profile(self._engine, self.profiler_dir)

    @app.post("/stop_profile", dependencies=[Depends(require_admin_key)])
    async def stop_profile(self) -> ProfileReply:
        return await admin.stop_profile(self._engine, self.profiler_dir)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist; this server serves "
                                   f"`{self.model_name}` (see /v1/models)", "model", "model_not_found")

    def _check_request(self, body: SamplingFields) -> None:
        self._check_model(body.model)
        body.check_supported()

    async def _model_card(self) -> ModelCard:
        info = await self._model_info()
        return ModelCard(id=self.model_name, root=self.model_path, max_model_len=info.limits.max_model_len)

    def _render(self, messages: list, tools: list | None, add_generation_prompt: bool) -> list[int]:
        try:
            text = render_chat(self.tokenizer, messages, tools, add_generation_prompt)
        except Exception as exc:  # the model's template refused this conversation (role order, say)
            raise OpenAIError(400, f"the chat template rejected the messages: {exc}", "messages") from exc
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _check_text_fits(self, num_chars: int, info: ModelInfo) -> None:
        """Refuses, before tokenizing it, text that needs more tokens than the context holds."""
        max_len = info.limits.max_model_len
        if num_chars > max_len * self.max_chars_per_token:
            raise OpenAIError(400, f"the prompt has {num_chars:,} characters; this model's maximum context length "
                                   f"is {max_len} tokens, which hold at most {max_len * self.max_chars_per_token:,} "
                                   f"characters. Shorten the prompt.", "prompt", "context_length_exceeded")

    async def _off_loop(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    async def _start(self, body: SamplingFields, tenant: Tenant, request_id: str, prompts: list[list[int]],
                     max_tokens: int | None,
                     logprobs: int | None, default_max_tokens: int | None, arrival: float,
                     prompt_logprobs: int | None = None, structured: StructuredOutput | None = None) -> Generation:
        """Checks the request with the engine's limits, sends it (every prompt in one engine call) and waits for
        its first tokens; an engine replica lost before then is retried once, elsewhere."""
        timeline = current_timeline()
        timeline.prompt_ready()
        bounds = (await self._model_info()).limits
        if max_tokens is None:
            capacity = min(bounds.max_model_len, bounds.num_kv_blocks * bounds.block_size)
            max_tokens = default_max_tokens or max(capacity - max(map(len, prompts)), 1)
        try:
            params = body.sampling_params(max_tokens, logprobs, prompt_logprobs, structured)
            for prompt in prompts:
                bounds.check(prompt, params, body.n)
        except InvalidRequestError as exc:
            raise OpenAIError.invalid(exc, body.field_name(exc.param)) from exc
        lease = current_lease()
        if lease is not None:  # counted as OpenAI counts: the prompt plus max_tokens for every choice
            lease.take_tokens(sum(map(len, prompts)) + max_tokens * body.n * len(prompts))
        request = EngineRequest(request_id, prompts[0], params, body.n, arrival, limits.request_deadline(),
                                more_prompt_token_ids=prompts[1:],
                                tenancy=tenant.tenancy(body.priority, body.cache_salt))
        timeline.dispatching(request_id)
        try:
            generation = await self._send(request, body, timeline)
        except ReplicaLost:
            note = ROUTING_NOTES.peek(request_id)
            retry = dataclasses.replace(request, avoid_replicas=(note.replica_id,) if note else ())
            log.warning("request %s: its engine replica was lost before the first token; retrying once", request_id)
            try:
                generation = await self._send(retry, body, timeline)
            except ReplicaLost as exc:
                raise OpenAIError(500, "the request failed on two engine replicas in a row; it was not retried "
                                       "further", code="engine_replica_lost") from exc
        self._engine_answered_at = time.monotonic()
        return generation

    async def _send(self, request: EngineRequest, body: SamplingFields, timeline: Any) -> Generation:
        stops, skip_special, n, prompts = request.sampling.stop, body.skip_special_tokens, request.n, request.prompts
        channel = await self._token_channel()
        if channel is None:
            responses = self._stream.generate.remote(request)
        else:
            responses = ChannelledStream(channel, lambda address, key: self._stream.generate.remote(
                dataclasses.replace(request, channel=address, channel_key=key)))
        generation = Generation(responses, n, [len(p) for p in prompts],
                                lambda i: IncrementalDetokenizer(self.tokenizer, stops, prompts[i // n], skip_special),
                                timeline)
        try:
            await generation.start()
        except BaseException:
            generation.cancel()
            raise
        return generation

    async def _token_channel(self) -> ChannelServer | None:
        """This replica's token channel, started on first use; None when it is off or could not start."""
        if self._channel is None and self._channel_wanted:
            async with self._channel_lock:
                if self._channel is None and self._channel_wanted:
                    server = ChannelServer(ray.util.get_node_ip_address(), _channel_counters())
                    try:
                        await server.start()
                        self._channel = server
                    except OSError as exc:
                        log.warning("the token channel could not start (%r); chunks stream through Serve", exc)
                        self._channel_wanted = False
        return self._channel

    async def _model_info(self) -> ModelInfo:
        if self._info is None:
            async with self._info_lock:
                if self._info is None:
                    try:
                        self._info = await self._engine.model_info.remote()
                        self._engine_answered_at = time.monotonic()
                    except BackPressureError as exc:  # Serve would answer this in plain text
                        raise limits.overloaded(f"every engine replica is busy and {exc.message}; "
                                                f"retry shortly") from exc
        return self._info

