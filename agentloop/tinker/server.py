"""`agentloop tinker serve`: the HTTP service the `tinker` SDK talks to (its /api/v1 paths), on aiohttp.

Map (who calls whom: handlers -> FutureStore / SeqOrder / TrainingModel (on the one training thread) / Sampler):
    TinkerService       the state: sessions, training models, sampling sessions, checkpoints, the futures
      session calls     client/config, client/dynamic_config, create_session, session_heartbeat, telemetry,
                        sessions/{id}/finish, healthz, get_server_capabilities: answered at once
      training calls    create_model, forward_backward (protobuf), optim_step, save_weights (save_state),
                        load_weights (load_state, or a new client from a state), save_weights_for_sampler: each
                        answers a future at once and runs on the training thread in the model's seq_id order
      sampling calls    create_sampling_session, samplers/{id}, asample: the future's result is the SGLang
                        server's tokens and logprobs (protobuf SampleResponse)
      retrieve_future   the long poll (agentloop.tinker.futures)
    checkpoint paths    tinker://<model_id>/weights/<name> (save_state) and .../sampler_weights/<name> map to
                        run_dir/checkpoints/<model_id>/{weights,sampler_weights}/<name>
    serve()             run until cancelled; prints the URL once listening

Anything else the SDK may send (custom losses uploaded to the server, weights export, training-run listings,
losses other than cross_entropy / importance_sampling / ppo, image chunks) is answered with the API's error
shape naming it (404 for a path, a failed future for an option). Auth: a non-loopback bind needs AGENTLOOP_TINKER_KEY,
and every request must then carry it as the SDK's API key (the X-API-Key header).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from agentloop.errors import ConfigError
from agentloop.tinker.backend import ModelSpec, TrainingModel, read_spec
from agentloop.tinker.config import KEY_ENV, TinkerServiceConfig
from agentloop.tinker.futures import FutureStore, Outcome, SeqOrder
from agentloop.tinker.sampler import Sampler
from agentloop.tinker.wire import decode_forward_backward, encode_forward_backward, encode_sample, error_body
from agentloop.tools.service import is_loopback

FULL_WEIGHTS_KEY = "agentloop_full_weights"
"""user_metadata key of create_model that asks for full-weights training (our extension)."""

CLIENT_CONFIG = {
    "pjwt_auth_enabled": False, "credential_default_source": "api_key", "use_pyqwest_transport": False,
    "parallel_fwdbwd_chunks": True, "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False, "sample_join_sampling_session": False, "sample_enable_stuck_detection": False,
}
"""The feature flags the SDK asks for first (ClientConfigResponse): API keys, plain httpx, per-request polling,
custom losses client-side."""


class UserError(ValueError):
    """A request we cannot serve as asked; answered with the error shape, category user."""


def resolve_model_path(model: str) -> Path:
    """`tiny`, a shape name of agentloop/models, or a local HF directory, as an absolute path (the name clients
    pass as base_model, which the SDK's get_tokenizer loads)."""
    from agentloop.models.modelzoo import resolve_named_model

    return resolve_named_model(model).resolve()


class TinkerService:
    """The service's state and handlers (module doc)."""

    def __init__(self, cfg: TinkerServiceConfig, sampler: Sampler, model_path: Path, key: str | None = None):
        self.cfg = cfg
        self.sampler = sampler
        self.model_path = model_path
        self.model_name = cfg.model_name or str(model_path)
        self.key = key
        self.run_dir = Path(cfg.run_dir)
        self.futures = FutureStore()
        self.models: dict[str, TrainingModel] = {}
        self.orders: dict[str, SeqOrder] = {}
        self.sessions: dict[str, dict[str, Any]] = {}
        self.samplers: dict[str, dict[str, Any]] = {}
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker-train")
        from transformers import AutoModelForCausalLM  # noqa: F401 - imported here: transformers' lazy import raced
        # when first done on the training thread while another thread imported from it
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ephemeral = 0

    # ------------------------------------------------------------------ app

    def app(self) -> Any:
        from aiohttp import web

        @web.middleware
        async def guard(request: web.Request, handler: Any) -> Any:
            if self.key is not None:
                got = request.headers.get("X-API-Key", "")
                if not hmac.compare_digest(got.encode(), self.key.encode()):
                    return web.json_response(error_body("unauthorized: this service needs its key as the Tinker API "
                                                        f"key (TINKER_API_KEY = the service's {KEY_ENV})"), status=401)
            try:
                return await handler(request)
            except web.HTTPNotFound:
                return web.json_response(error_body(f"{request.method} {request.path} is not supported by agentloop's "
                                                    "Tinker service (docs/tinker.md lists what is)"), status=404)
            except UserError as e:
                return web.json_response(error_body(str(e)), status=400)
            except Exception as e:  # a body the SDK's own types refuse
                from pydantic import ValidationError

                if isinstance(e, (ValidationError, json.JSONDecodeError)):
                    return web.json_response(error_body(f"bad request body for {request.path}: {e}"), status=400)
                raise

        app = web.Application(middlewares=[guard], client_max_size=1 << 30)
        def fixed(body: dict[str, Any]) -> Any:
            async def handler(request: web.Request) -> web.Response:
                return web.json_response(body)

            return handler

        r = app.router
        r.add_get("/api/v1/healthz", fixed({"status": "ok"}))
        r.add_post("/api/v1/client/config", fixed(CLIENT_CONFIG))
        r.add_post("/api/v1/client/dynamic_config", fixed({}))
        r.add_post("/api/v1/create_session", self._create_session)
        r.add_post("/api/v1/session_heartbeat", fixed({"type": "session_heartbeat"}))
        r.add_post("/api/v1/telemetry", fixed({"status": "accepted"}))
        r.add_post("/api/v1/sessions/{sid}/finish", fixed({}))
        r.add_get("/api/v1/get_server_capabilities", self._capabilities)
        r.add_post("/api/v1/create_model", self._create_model)
        r.add_post("/api/v1/get_info", self._get_info)
        r.add_post("/api/v1/forward_backward", self._forward_backward)
        r.add_post("/api/v1/optim_step", self._optim_step)
        r.add_post("/api/v1/save_weights", self._save_weights)
        r.add_post("/api/v1/load_weights", self._load_weights)
        r.add_post("/api/v1/save_weights_for_sampler", self._save_for_sampler)
        r.add_post("/api/v1/create_sampling_session", self._create_sampling_session)
        r.add_get("/api/v1/samplers/{sid}", self._get_sampler)
        r.add_post("/api/v1/asample", self._asample)
        r.add_post("/api/v1/retrieve_future", self._retrieve)
        return app

    @staticmethod
    def _json(body: Any, status: int = 200) -> Any:
        from aiohttp import web

        return web.json_response(body, status=status)

    async def _body(self, request: Any, cls: Any) -> Any:
        return cls.model_validate(json.loads(await request.read() or b"{}"))

    # ------------------------------------------------------------------ futures

    def _spawn(self, rid: str, coro: Any) -> None:
        """Run `coro` for request `rid`; its value (Outcome) or exception becomes the request's outcome."""
        async def run() -> None:
            try:
                self.futures.finish(rid, await coro)
            except (UserError, ValueError, KeyError, TimeoutError) as e:
                self.futures.fail(rid, str(e) if not isinstance(e, KeyError) else f"unknown {e}", "user")
            except Exception as e:  # noqa: BLE001 - the request boundary: any failure becomes the future's error
                self.futures.fail(rid, f"{type(e).__name__}: {e}", "server")

        task = asyncio.create_task(run(), name=f"tinker-{rid}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _future(self, kind: str, coro: Any, model_id: str | None = None, samples: int = 0) -> Any:
        """Start `coro` and answer the SDK's UntypedAPIFuture (a sample's names each sequence)."""
        rid = self.futures.create(kind)
        self._spawn(rid, coro)
        body: dict[str, Any] = {"request_id": rid}
        if model_id:
            body["model_id"] = model_id
        if samples:
            body["sample_sequence_ids"] = [f"{rid}-{i}" for i in range(samples)]
        return self._json(body)

    async def _train(self, model_id: str, seq_id: int | None, fn: Any, *args: Any) -> Any:
        """Run `fn(model, *args)` on the training thread in the model's seq_id order."""
        if model_id not in self.models:
            raise UserError(f"unknown model_id {model_id!r} (created by this service's create_model / load_weights?)")
        order = self.orders[model_id]
        await order.turn(seq_id)
        fut = asyncio.get_running_loop().run_in_executor(self.pool, fn, self.models[model_id], *args)
        await order.done(seq_id)
        return await fut

    async def _retrieve(self, request: Any) -> Any:
        from aiohttp import web
        from tinker.types import FutureRetrieveRequest

        req = await self._body(request, FutureRetrieveRequest)
        if not self.futures.known(req.request_id):
            return self._json(error_body(f"unknown request_id {req.request_id!r}"), status=404)
        out = await self.futures.wait(req.request_id, self.cfg.poll_s)
        if out is None:
            return self._json({"type": "try_again", "request_id": req.request_id, "queue_state": "active"})
        if out.proto is not None:
            return web.Response(body=out.proto, content_type="application/x-protobuf")
        return self._json(out.json)

    # ------------------------------------------------------------------ session calls

    async def _create_session(self, request: Any) -> Any:
        from tinker.types import CreateSessionRequest

        req = await self._body(request, CreateSessionRequest)
        sid = f"s{uuid.uuid4().hex[:12]}"
        self.sessions[sid] = {"tags": req.tags, "user_metadata": req.user_metadata}
        return self._json({"type": "create_session", "session_id": sid})

    async def _capabilities(self, request: Any) -> Any:
        return self._json({"supported_models": [{"model_name": self.model_name, "trainable": True,
                                                  "sampleable": True, "max_context_length": None}]})

    def _check_base(self, base_model: str | None) -> None:
        if base_model is not None and base_model not in (self.model_name, str(self.model_path)):
            raise UserError(f"base_model {base_model!r} is not served here: this service serves {self.model_name!r}")

    # ------------------------------------------------------------------ training calls

    def _new_model(self, model_id: str, spec: ModelSpec) -> Outcome:
        self.models[model_id] = TrainingModel(spec, device=self.cfg.device, dtype=self.cfg.dtype)
        self.orders[model_id] = SeqOrder()
        return Outcome(json={"model_id": model_id, "type": "create_model"})

    async def _create_model(self, request: Any) -> Any:
        from tinker.types import CreateModelRequest

        req = await self._body(request, CreateModelRequest)
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        self._check_base(req.base_model)
        meta = req.user_metadata or {}
        full = str(meta.get(FULL_WEIGHTS_KEY, "")).lower() in ("1", "true", "yes")
        if getattr(req.optimizer_config, "type", "adamw") != "adamw":
            raise UserError(f"optimizer {req.optimizer_config.type!r} is not supported (adamw only)")
        if full and not self.cfg.allow_full_weights:
            raise UserError("full-weights training is switched off on this service (allow_full_weights=false)")
        lora = req.lora_config
        if not full and lora is None:
            raise UserError("create_model without lora_config: set user_metadata "
                            f"{{'{FULL_WEIGHTS_KEY}': 'true'}} for full weights (agentloop's extension)")
        if lora is not None and not full and lora.rank > self.cfg.max_lora_rank:
            raise UserError(f"LoRA rank {lora.rank} exceeds this service's max_lora_rank {self.cfg.max_lora_rank}")
        spec = ModelSpec(base_model=req.base_model, model_path=str(self.model_path),
                         lora_rank=None if full else lora.rank, lora_alpha=self.cfg.lora_alpha,
                         train_attn=True if full else lora.train_attn, train_mlp=True if full else lora.train_mlp,
                         seed=(lora.seed or 0) if lora else 0)
        loop = asyncio.get_running_loop()
        return self._future("create_model", loop.run_in_executor(self.pool, self._new_model, model_id, spec),
                            model_id=model_id)

    async def _get_info(self, request: Any) -> Any:
        from tinker.types import GetInfoRequest

        req = await self._body(request, GetInfoRequest)
        m = self.models.get(req.model_id)
        if m is None:
            return self._json(error_body(f"unknown model_id {req.model_id!r}"), status=404)
        arch = json.loads((self.model_path / "config.json").read_text()).get("architectures", [None])[0]
        return self._json({"type": "get_info", "model_id": req.model_id, "model_name": self.model_name,
                           "model_data": {"arch": arch, "model_name": self.model_name,
                                          "tokenizer_id": str(self.model_path)},
                           "is_lora": m.spec.is_lora, "lora_rank": m.spec.lora_rank})

    async def _forward_backward(self, request: Any) -> Any:
        from google.protobuf.message import DecodeError

        body = await request.read()
        try:
            req = decode_forward_backward(body, request.headers.get("Content-Encoding"))
        except ValueError as e:
            raise UserError(str(e)) from None
        except DecodeError as e:
            raise UserError(f"forward_backward body is not the SDK's protobuf ForwardBackwardRequest ({e})") from None

        async def run() -> Outcome:
            outs, metrics = await self._train(req.model_id, req.seq_id, TrainingModel.forward_backward, req)
            return Outcome(proto=encode_forward_backward(outs, metrics))

        return self._future("forward_backward", run(), model_id=req.model_id)

    async def _optim_step(self, request: Any) -> Any:
        from tinker.types import AdamParams, OptimStepRequest

        req = await self._body(request, OptimStepRequest)
        if not isinstance(req.optim_params, AdamParams):
            raise UserError(f"optimizer params of type {getattr(req.optim_params, 'type', '?')!r} are not supported "
                            "(AdamParams only)")

        async def run() -> Outcome:
            metrics = await self._train(req.model_id, req.seq_id, TrainingModel.optim_step, req.optim_params)
            return Outcome(json={"metrics": metrics})

        return self._future("optim_step", run(), model_id=req.model_id)

    def _ckpt_dir(self, model_id: str, kind: str, name: str) -> Path:
        safe = model_id.replace(":", "_").replace("/", "_")
        if not name or "/" in name or name.startswith("."):
            raise UserError(f"checkpoint name {name!r}: give a plain name (no '/')")
        return self.run_dir / "checkpoints" / safe / kind / name

    def _resolve(self, tinker_path: str, kind: str) -> Path:
        """A tinker:// path this service wrote -> its directory."""
        if not tinker_path.startswith("tinker://"):
            raise UserError(f"{tinker_path!r} is not a tinker:// path")
        parts = tinker_path[len("tinker://"):].split("/")
        if len(parts) != 3 or parts[1] != kind:
            raise UserError(f"{tinker_path!r}: expected tinker://<model_id>/{kind}/<name>")
        d = self._ckpt_dir(parts[0], kind, parts[2])
        if not d.exists():
            raise UserError(f"checkpoint {tinker_path!r} does not exist on this service ({d})")
        return d

    async def _save_weights(self, request: Any) -> Any:
        from tinker.types import SaveWeightsRequest

        req = await self._body(request, SaveWeightsRequest)
        name = req.path or f"state-{uuid.uuid4().hex[:8]}"
        out = self._ckpt_dir(req.model_id, "weights", name)
        if out.exists() and not req.overwrite and req.path is not None:
            raise UserError(f"checkpoint tinker://{req.model_id}/weights/{name} exists (overwrite=True replaces it)")

        async def run() -> Outcome:
            await self._train(req.model_id, req.seq_id, TrainingModel.save_state, out)
            return Outcome(json={"path": f"tinker://{req.model_id}/weights/{name}", "type": "save_weights"})

        return self._future("save_weights", run(), model_id=req.model_id)

    async def _load_weights(self, request: Any) -> Any:
        from tinker.types import LoadWeightsRequest

        req = await self._body(request, LoadWeightsRequest)
        src = self._resolve(req.path, "weights")
        if req.model_id is not None:  # into an existing training client
            async def run() -> Outcome:
                await self._train(req.model_id, req.seq_id, TrainingModel.load_state, src, req.optimizer)
                return Outcome(json={"path": req.path, "model_id": req.model_id, "type": "load_weights"})

            return self._future("load_weights", run(), model_id=req.model_id)
        if req.session_id is None or req.model_seq_id is None:
            raise UserError("load_weights needs model_id, or session_id and model_seq_id (a new training client)")
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        self._check_base(req.base_model)

        def create() -> Outcome:
            spec = read_spec(src)
            self._new_model(model_id, spec)
            self.models[model_id].load_state(src, req.optimizer)
            return Outcome(json={"path": req.path, "model_id": model_id, "type": "load_weights"})

        return self._future("load_weights", asyncio.get_running_loop().run_in_executor(self.pool, create),
                            model_id=model_id)

    async def _save_for_sampler(self, request: Any) -> Any:
        from tinker.types import SaveWeightsForSamplerRequest

        req = await self._body(request, SaveWeightsForSamplerRequest)
        if req.path is None:
            self._ephemeral += 1
            name = f"sampler-{self._ephemeral}"
        else:
            name = req.path
        out = self._ckpt_dir(req.model_id, "sampler_weights", name)
        tpath = f"tinker://{req.model_id}/sampler_weights/{name}"

        async def run() -> Outcome:
            await self._train(req.model_id, req.seq_id, TrainingModel.save_for_sampler, out)
            body: dict[str, Any] = {"path": tpath, "type": "save_weights_for_sampler"}
            if req.path is None:
                body["sampling_session_id"] = await self._open_sampling(tpath, None)
            return Outcome(json=body)

        return self._future("save_weights_for_sampler", run(), model_id=req.model_id)

    # ------------------------------------------------------------------ sampling calls

    async def _open_sampling(self, model_path: str | None, base_model: str | None) -> str:
        """A sampling session on the base model or on sampler weights (a LoRA adapter is loaded by name)."""
        adapter = full = None
        if model_path is not None:
            d = self._resolve(model_path, "sampler_weights")
            if (d / "adapter_config.json").exists():
                adapter = "tk-" + uuid.uuid5(uuid.NAMESPACE_URL, str(d.resolve()) + str(d.stat().st_mtime_ns)).hex[:16]
                await self.sampler.load_adapter(adapter, str(d.resolve()))
            else:
                full = str(d.resolve())
        else:
            self._check_base(base_model)
        sid = f"samp-{uuid.uuid4().hex[:12]}"
        self.samplers[sid] = {"model_path": model_path, "adapter": adapter, "full": full}
        return sid

    async def _create_sampling_session(self, request: Any) -> Any:
        from tinker.types import CreateSamplingSessionRequest

        req = await self._body(request, CreateSamplingSessionRequest)
        sid = await asyncio.wait_for(self._open_sampling(req.model_path, req.base_model), self.cfg.request_timeout_s)
        return self._json({"type": "create_sampling_session", "sampling_session_id": sid})

    async def _get_sampler(self, request: Any) -> Any:
        sid = request.match_info["sid"]
        s = self.samplers.get(sid)
        if s is None:
            return self._json(error_body(f"unknown sampler {sid!r}"), status=404)
        return self._json({"sampler_id": sid, "base_model": self.model_name, "model_path": s["model_path"]})

    async def _asample(self, request: Any) -> Any:
        from tinker.types import SampleRequest

        req = await self._body(request, SampleRequest)
        unsupported = [n for n, v in (("topk_prompt_logprobs", req.topk_prompt_logprobs),
                                      ("topk_sample_logprobs", req.topk_sample_logprobs),
                                      ("target_prompt_logprobs", req.target_prompt_logprobs),
                                      ("prompt_alt_tokens_k", req.prompt_alt_tokens_k),
                                      ("prompt_logprobs_last_n", req.prompt_logprobs_last_n),
                                      ("record_stability_info", req.record_stability_info)) if v]
        if req.sampling_session_id is not None:
            s = self.samplers.get(req.sampling_session_id)
            if s is None:
                raise UserError(f"unknown sampling_session_id {req.sampling_session_id!r}")
        else:
            s = None
        try:
            prompt = req.prompt.to_ints()
        except ValueError as e:
            raise UserError(f"sample: {e} (this service samples text models)") from None

        async def run() -> Outcome:
            if unsupported:
                raise UserError(f"sample options not supported by agentloop's Tinker service: {unsupported}")
            nonlocal s
            if s is None:
                sid = await self._open_sampling(req.model_path, req.base_model)
                s = self.samplers[sid]
            seqs, plp = await self.sampler.sample(prompt, req.sampling_params, req.num_samples, adapter=s["adapter"],
                                                  full=s["full"], prompt_logprobs=bool(req.prompt_logprobs))
            return Outcome(proto=encode_sample(seqs, plp))

        return self._future("sample", run(), samples=req.num_samples)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.pool.shutdown(wait=True, cancel_futures=True)


async def serve(cfg: TinkerServiceConfig, *, key: str | None = None, ready: Any = None) -> None:
    """Run the service until cancelled: launch (or reach) the SGLang server, then listen; prints the URL (or calls
    `ready(url)`) once both are up."""
    from aiohttp import web

    try:
        import tinker  # noqa: F401
    except ImportError:
        raise ConfigError("agentloop tinker serve needs the tinker SDK (its wire types): pip install "
                          "'agentloop[tinker]'") from None
    if not is_loopback(cfg.host) and not key:
        raise ConfigError(f"binding {cfg.host!r} (not localhost) needs a shared secret: set {KEY_ENV} on the service "
                          "and give clients the same value as their TINKER_API_KEY")
    if key is not None and not key.startswith("tml-"):
        raise ConfigError(f"{KEY_ENV} must start with 'tml-' (the tinker SDK refuses other API keys)")
    model_path = resolve_model_path(cfg.model)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    sampler = Sampler(model_path, device=cfg.device, max_lora_rank=cfg.max_lora_rank,
                      log_path=run_dir / "sglang.log", startup_timeout_s=cfg.startup_timeout_s,
                      request_timeout_s=cfg.request_timeout_s, url=cfg.server_url)
    service = None
    runner = None
    try:
        await sampler.start()
        service = TinkerService(cfg, sampler, model_path, key=key)
        runner = web.AppRunner(service.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, cfg.host, cfg.port)
        await site.start()
        port = runner.addresses[0][1] if runner.addresses else cfg.port
        url = f"http://{cfg.host}:{port}"
        if ready is not None:
            ready(url)
        else:
            print(f"agentloop tinker: serving {service.model_name} on {url} (sampling on {sampler.url})"
                  + (" (key required)" if key else ""), flush=True)
        await asyncio.Event().wait()
    finally:
        if service is not None:
            await service.close()
        if runner is not None:
            await runner.cleanup()
        await sampler.close()


def key_from_env() -> str | None:
    return os.environ.get(KEY_ENV) or None
