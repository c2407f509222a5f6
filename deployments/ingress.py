"""The OpenAI-compatible HTTP front (FastAPI through @serve.ingress): validate, template, tokenize, stream back.

The engine sees token ids only; text lives here, where each choice is detokenized incrementally.
"""
# No `from __future__ import annotations`: FastAPI must see real types through Serve's rewritten signatures.
import asyncio
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
from deployments.generation import Generation
from deployments.http_metrics import HttpMetricsMiddleware
from deployments.limits import RequestLimitsMiddleware
from deployments.openai_format import (TokenText, chat_response, chat_stream, completion_response,
                                       completion_stream, json_response)
from deployments.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from deployments.records import EngineRequest, ModelInfo
from deployments.responses import ModelCard, ModelList
from deployments.timeline import TimelineView
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
        self._info: ModelInfo | None = None
        self._info_lock = asyncio.Lock()
        auth.configure(args.security)
        limits.configure(args.limits)
        self.timelines = timeline_recorder.configure(args.timeline, self.model_name)
        self.profiler_dir = args.profiler_dir
        log.info("ingress ready for model %r (%s)", self.model_name, self.model_path)

    @app.get("/health")
    async def health(self) -> dict[str, str]:
        try:
            await asyncio.wait_for(self._model_info(), timeout=10)
        except Exception as exc:
            raise OpenAIError(503, f"no engine replica answers: {type(exc).__name__}") from exc
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=[Depends(require_api_key)])
    async def models(self) -> ModelList:
        info = await self._model_info()
        return ModelList(data=[ModelCard(id=self.model_name, root=self.model_path, max_model_len=info.max_model_len)])

    @app.post("/v1/completions", dependencies=[Depends(require_api_key)])
    async def completions(self, body: CompletionRequest) -> Any:
        arrival = time.time()
        self._check_request(body)
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            prompt_ids, prompt_text = self.tokenizer.encode(prompt), prompt
        else:
            prompt_ids, prompt_text = list(prompt), ""
            if body.echo:
                prompt_text = self.tokenizer.decode(prompt_ids)
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
        prompt_ids = self._chat_prompt(body)
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

    async def _start(self, body: SamplingFields, kind: str, prompt_ids: list[int], max_tokens: int | None,
                     logprobs: int | None, default_max_tokens: int | None,
                     arrival: float) -> tuple[Generation, str]:
        """Validates against the model's limits, sends the request and waits for its first tokens."""
        timeline = current_timeline()
        timeline.prompt_ready()
        info = await self._model_info()
        n = len(prompt_ids)
        if any(not isinstance(t, int) or not 0 <= t < info.vocab_size for t in prompt_ids):
            raise OpenAIError(400, f"prompt token ids must be in [0, {info.vocab_size})", "prompt")
        capacity = min(info.max_model_len, info.num_kv_blocks * info.block_size)
        if max_tokens is None:
            max_tokens = default_max_tokens or max(capacity - n, 1)
        if n + max_tokens > info.max_model_len:
            raise OpenAIError(400, f"This model's maximum context length is {info.max_model_len} tokens. However, "
                                   f"you requested {n + max_tokens} tokens ({n} in the prompt, {max_tokens} for "
                                   f"max_tokens). Shorten the prompt or lower max_tokens.",
                              "max_tokens", "context_length_exceeded")
        try:
            params = body.sampling_params(max_tokens, logprobs)
            stops = body.stop_strings()
        except InvalidRequestError as exc:
            raise OpenAIError.invalid(exc) from exc
        request_id = f"{kind}-{uuid.uuid4().hex}"
        request = EngineRequest(request_id, prompt_ids, params, body.n, arrival)
        skip_special = body.skip_special_tokens
        timeline.dispatching(request_id)
        generation = Generation(self._stream.generate.remote(request), body.n, n,
                                lambda: IncrementalDetokenizer(self.tokenizer, stops, prompt_ids, skip_special),
                                timeline)
        try:
            await generation.start()
        except BaseException:
            generation.cancel()
            raise
        return generation, request_id

    async def _model_info(self) -> ModelInfo:
        if self._info is None:
            async with self._info_lock:
                if self._info is None:
                    try:
                        self._info = await self._engine.model_info.remote()
                    except BackPressureError as exc:  # Serve would answer this in plain text
                        raise limits.overloaded(f"every engine replica is busy and {exc.message}; "
                                                f"retry shortly") from exc
        return self._info

