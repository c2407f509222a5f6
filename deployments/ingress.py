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
import logging
import time
import uuid
from typing import Any

from fastapi import Depends, FastAPI, Query
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from deployments import auth, limits
from deployments import admin, timeline_recorder
from deployments.admin import ProfileReply
from deployments.auth import require_admin_key, require_api_key
from deployments.config import AppArgs
from deployments.detokenizer import IncrementalDetokenizer
from deployments.errors import OpenAIError, install_error_handlers
from deployments.generation import Generation, ReplicaLost
from deployments.http_metrics import HttpMetricsMiddleware
from deployments.limits import RequestLimitsMiddleware
from deployments.openai_format import (TokenText, chat_response, chat_stream, completion_response,
                                       completion_stream, json_response)
from deployments.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from deployments.records import EngineRequest, ModelInfo
from deployments.responses import ModelCard, ModelList
from deployments.timeline import ROUTING_NOTES, TimelineView
from deployments.timeline_recorder import TimelineMiddleware, current_timeline
from engine.loader import load_tokenizer
from engine.sampling_params import InvalidRequestError

log = logging.getLogger(__name__)

app = FastAPI(title="tokenline", docs_url=None, redoc_url=None)
install_error_handlers(app)
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


@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, engine: DeploymentHandle, args: AppArgs) -> None:
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
        info = await self._model_info()
        return ModelList(data=[ModelCard(id=self.model_name, root=self.model_path,
                                         max_model_len=info.limits.max_model_len)])

    @app.post("/v1/completions", dependencies=[Depends(require_api_key)])
    async def completions(self, body: CompletionRequest) -> Any:
        arrival = time.time()
        self._check_request(body)
        prompt = body.single_prompt()
        info = await self._model_info()
        if isinstance(prompt, str):
            self._check_text_fits(len(prompt), info)
            prompt_ids, prompt_text = await self._off_loop(self.tokenizer.encode, prompt), prompt
        else:
            prompt_ids, prompt_text = list(prompt), ""
            if body.echo:
                info.limits.check_token_ids("prompt", prompt_ids)  # decoding an unknown id would fail
                prompt_text = await self._off_loop(self.tokenizer.decode, prompt_ids)
        generation, request_id = await self._start(body, "cmpl", prompt_ids, body.max_tokens, body.logprobs,
                                                    COMPLETIONS_DEFAULT_MAX_TOKENS, arrival)
        echo = prompt_text if body.echo else ""
        want_logprobs = body.logprobs is not None
        if body.stream:
            return _sse(completion_stream(generation, request_id, self.model_name, echo, self.tokens, want_logprobs,
                                          body.include_usage))
        response = await completion_response(generation, request_id, self.model_name, echo, self.tokens,
                                             want_logprobs)
        return json_response(response, generation)

    @app.post("/v1/chat/completions", dependencies=[Depends(require_api_key)])
    async def chat(self, body: ChatCompletionRequest) -> Any:
        arrival = time.time()
        self._check_request(body)
        self._check_text_fits(sum(len(m.text()) for m in body.messages), await self._model_info())
        prompt_ids = await self._off_loop(self._chat_prompt, body)
        generation, request_id = await self._start(body, "chatcmpl", prompt_ids, body.requested_max_tokens(),
                                                    body.requested_logprobs(), None, arrival)
        if body.stream:
            return _sse(chat_stream(generation, request_id, self.model_name, self.tokens, body.logprobs,
                                    body.include_usage))
        response = await chat_response(generation, request_id, self.model_name, self.tokens, body.logprobs)
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

    def _check_request(self, body: SamplingFields) -> None:
        if body.model is not None and body.model != self.model_name:
            raise OpenAIError(404, f"The model `{body.model}` does not exist; this server serves "
                                   f"`{self.model_name}` (see /v1/models)", "model", "model_not_found")
        body.check_supported()

    def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                                      tokenize=False)
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

    async def _start(self, body: SamplingFields, kind: str, prompt_ids: list[int], max_tokens: int | None,
                     logprobs: int | None, default_max_tokens: int | None,
                     arrival: float) -> tuple[Generation, str]:
        """Checks the request with the engine's limits, sends it and waits for its first tokens; an engine replica
        lost before then is retried once, elsewhere."""
        timeline = current_timeline()
        timeline.prompt_ready()
        info = await self._model_info()
        bounds = info.limits
        if max_tokens is None:
            capacity = min(bounds.max_model_len, bounds.num_kv_blocks * bounds.block_size)
            max_tokens = default_max_tokens or max(capacity - len(prompt_ids), 1)
        params = body.sampling_params(max_tokens, logprobs)
        try:
            bounds.check(prompt_ids, params, body.n)
        except InvalidRequestError as exc:
            raise OpenAIError.invalid(exc, body.field_name(exc.param)) from exc
        request_id = f"{kind}-{uuid.uuid4().hex}"
        request = EngineRequest(request_id, prompt_ids, params, body.n, arrival, limits.request_deadline())
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
        return generation, request_id

    async def _send(self, request: EngineRequest, body: SamplingFields, timeline: Any) -> Generation:
        stops, skip_special, prompt_ids = request.sampling.stop, body.skip_special_tokens, request.prompt_token_ids
        generation = Generation(self._stream.generate.remote(request), request.n, len(prompt_ids),
                                lambda: IncrementalDetokenizer(self.tokenizer, stops, prompt_ids, skip_special),
                                timeline)
        try:
            await generation.start()
        except BaseException:
            generation.cancel()
            raise
        return generation

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

