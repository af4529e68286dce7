"""One shallow pydantic config tree for everything a user may set.

Map:
    Section            base: forbids unknown keys, validates on assignment
    ModelConfig        which model/tokenizer (None = the project's built-in tiny model)
    ServerConfig       which servers: URLs to connect to, or local ones to launch
    ManagerConfig      client-side routing, concurrency caps, timeouts, retries, health checks
    SamplingConfig     per-request sampling settings (SamplingParams is the typed per-call copy)
    DataConfig         where rows come from
    RolloutConfig      which loop, how many samples, how much concurrency, the run seed
    RewardConfig       reward selection
    AgentConfig, GatewayConfig  your own agent and the HTTP gateway it talks to (agentloop/gateway/config.py)
    EnvsConfig         environment libraries' environments: verifiers, reasoning-gym, TextArena, OpenEnv
                       (agentloop/envs_config.py)
    JournalConfig      the episode journal of a training run (agentloop/journal/config.py)
    ClusterConfig      where a training run's servers and learner run (this host, or a Ray cluster), and the GPUs
                       it plans for (`agentloop train --dry-run` can plan for absent ones)
    Config             the root; `load_config(path, overrides)` builds it
    validate_for_training  the rules that hold only when rollouts train a policy (`agentloop train`):
                       one temperature for sampler and learner, no greedy, no truncated sampling

YAML files in configs/ hold any subset of the tree; `key.sub=value` overrides (values parsed
as YAML) are applied on top. Parsing is done before any heavy import so a typo fails in
milliseconds with the offending key named; a key that was renamed or removed (MOVED_KEYS) is an
error naming its replacement.

Words. "async" in a key or value is the training schedule's alone: `train.schedule=async`, rollouts
overlapping the learner's updates (the `async/*` metrics of a step's row). The event loop everything runs
on is "asyncio" (an "async def" reward or loop is a coroutine function), and checkpoints written while
training goes on are `learner.checkpoint_background`. Weights reach the servers by
`learner.weight_sync` (disk, tensor, nccl), the one key that names the path.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from agentloop.envs_config import EnvsConfig
from agentloop.errors import ConfigError
from agentloop.gateway.config import AgentConfig, GatewayConfig
from agentloop.journal.config import JournalConfig
from agentloop.rewards.config import CodeRewardConfig, ToolRewardConfig
from agentloop.tools.config import ToolsConfig
from agentloop.train.config import AlgoConfig, LearnerConfig


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class ModelConfig(Section):
    path: str | None = None
    """Local Hugging Face model directory. None: build (once, cached) the project's tiny Qwen2 model."""
    tokenizer_path: str | None = None
    """Tokenizer directory; None means the model directory."""
    context_length: int | None = Field(default=None, ge=16)
    """Max tokens (prompt + response) per sequence. None: the model's max_position_embeddings."""


class ServerConfig(Section):
    urls: list[str] = Field(default_factory=list)
    """Running SGLang servers to use (http://host:port). Empty: launch `num_local` servers."""
    num_local: int = Field(default=1, ge=0)
    """How many local SGLang servers to launch when `urls` is empty (one per GPU on CUDA)."""
    gpus: list[int] | None = None
    """GPU of each local CUDA server (one entry per server). None: server i on GPU i. Placement:
    `server.gpus=[0] learner.gpus=[1]` puts them on separate GPUs; `[0]` and `[0]` colocates them."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where local servers run. auto: cuda if a GPU is visible, else cpu (SGLang's CPU engine)."""
    host: str = "127.0.0.1"
    """Interface local servers bind to."""
    base_port: int = Field(default=0, ge=0, le=65535)
    """First port for local servers; 0 picks free ports."""
    max_total_tokens: int | None = Field(default=16384, ge=256)
    """KV-cache pool size in tokens for local servers (SGLang's default sizing takes ~15 GB on CPU). On CUDA
    `agentloop train` leaves the pool to the memory plan (None) unless this is set."""
    mem_fraction_static: float | None = Field(default=None, gt=0, lt=1)
    """GPU memory fraction for weights + KV cache on local CUDA servers. None: `agentloop train` plans it
    (agentloop.train.planning.memory: next to the learner on a shared GPU, the weights and the KV of the episodes in
    flight; alone on a GPU, SGLang's own sizing), `agentloop rollout` leaves it to SGLang."""
    extra_args: list[str] = Field(default_factory=list)
    """Extra command-line arguments passed verbatim to `sglang.launch_server`."""
    startup_timeout_s: float = Field(default=300.0, gt=0)
    """Deadline for a local server to answer /health after launch."""
    shutdown_timeout_s: float = Field(default=20.0, gt=0)
    """Grace period between SIGTERM and SIGKILL when stopping local servers."""
    lend_learner_gpus: bool = False
    """Idle learner GPUs serve rollouts (`agentloop train`): the servers on the learner's GPUs (`lent_servers`) take
    episodes while the learner waits for a batch and sleep while it trains: new episodes are routed away, the calls
    running there continue at once on a server awake (same weights, per-token versions exact), and their KV cache
    is released (SGLang's /release_memory_occupation; such servers need --enable-memory-saver on CUDA), then
    resumed once the step's weights reached them. The weight push reaches them with the others (weights stay
    resident): with learner.weight_sync=tensor by CUDA IPC. See the README's async section for when it pays."""
    lent_servers: list[int] | None = None
    """With lend_learner_gpus: the indices (in server.urls, or of the local servers) of the servers that sleep
    while the learner trains. None: the local servers whose GPU (server.gpus) is one of learner.gpus; with
    server.urls it must be given (agentloop cannot tell where a server it did not launch runs)."""
    lend_release: list[Literal["kv_cache", "cuda_graph"]] = Field(default_factory=lambda: ["kv_cache"])
    """What a sleeping lent server releases (SGLang's memory tags); empty: nothing (it only stops taking episodes:
    a KV pool sized to fit beside the learner). Its weights stay resident, so the weight push reaches it asleep."""

    @model_validator(mode="after")
    def _check_gpus(self) -> "ServerConfig":
        if self.gpus is not None:
            if len(self.gpus) != self.num_local:
                raise ValueError(f"server.gpus lists {len(self.gpus)} GPU(s) for server.num_local={self.num_local} "
                                 "servers: give one GPU per server")
            if any(g < 0 for g in self.gpus):
                raise ValueError(f"server.gpus holds a negative GPU index: {self.gpus}")
        return self

    @field_validator("urls")
    @classmethod
    def _check_urls(cls, urls: list[str]) -> list[str]:
        out = []
        for u in urls:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"server url {u!r} must start with http:// or https://")
            out.append(u.rstrip("/"))
        if len(set(out)) != len(out):
            raise ValueError(f"server urls contain duplicates: {out}")
        return out


class ConcurrencyConfig(Section):
    """Requests in flight per server, sized from what each server reports (agentloop.client.concurrency): raised
    while it has room, lowered before it queues or preempts (AIMD)."""

    adaptive: bool = False
    """Follow the servers: poll each one's load (SGLang's /v1/loads) and set its limit by the rule in
    agentloop.client.concurrency. Off: the fixed cap of manager.max_inflight_per_server, or the server's reported
    max_running_requests."""
    initial: int = Field(default=64, ge=1)
    """Each server's limit before its first report."""
    min_limit: int = Field(default=4, ge=1)
    """The limit never goes below this."""
    max_limit: int = Field(default=1024, ge=1)
    """Hard cap: the limit never goes above this (nor above manager.max_inflight_per_server when set, nor above
    the requests the server says it runs at once)."""
    kv_soft: float = Field(default=0.85, gt=0, le=1)
    """Soft cap on KV usage: at or above this fraction of its KV pool a server's limit is no longer raised."""
    kv_hard: float = Field(default=0.95, gt=0, le=1)
    """Hard cap on KV usage: at or above this fraction the limit is lowered (before the server has to retract)."""
    max_queued: int = Field(default=0, ge=0)
    """Requests waiting in a server's queue that are tolerated; more lower its limit."""
    increase: int = Field(default=8, ge=1)
    """Additive increase per poll while the server has room and the limit is reached."""
    decrease: float = Field(default=0.75, gt=0, lt=1)
    """Multiplicative decrease when the server queues, retracts or passes kv_hard."""
    kv_settle: float = Field(default=0.05, ge=0, le=1)
    """The limit grows only while a server's KV usage rose by less than this since the previous poll: KV usage lags
    (an admitted request's KV grows over its whole generation), so raising faster than it settles overshoots."""
    busy_frac: float = Field(default=0.9, gt=0, le=1)
    """The limit counts as reached (and may grow) when the requests in flight are at least this fraction of it."""
    poll_s: float = Field(default=0.5, gt=0)
    """Period of the load polls (each with manager.health_timeout_s as its timeout)."""

    @model_validator(mode="after")
    def _marks(self) -> "ConcurrencyConfig":
        if self.kv_soft > self.kv_hard:
            raise ValueError(f"manager.concurrency.kv_soft ({self.kv_soft}) must be <= kv_hard ({self.kv_hard})")
        if self.min_limit > self.max_limit:
            raise ValueError(f"manager.concurrency.min_limit ({self.min_limit}) must be <= max_limit "
                             f"({self.max_limit})")
        return self


class ManagerConfig(Section):
    max_inflight_per_server: int | None = Field(default=None, ge=1)
    """Cap on concurrent /generate requests per server; further requests wait or spill over. null (the
    default): each server's cap is what it reports it runs at once (SGLang's max_running_requests in
    /server_info), 256 for a server that does not say; a number: that cap for every server."""
    sticky: bool = True
    """Route all turns of an episode to the same server (prefix-cache reuse) unless it is full or down."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """Timeout of one /generate attempt (connect + full response)."""
    connect_timeout_s: float = Field(default=10.0, gt=0)
    """Timeout to open a connection to a server."""
    connect_attempt_s: float = Field(default=2.0, gt=0)
    """One connect attempt's share of connect_timeout_s: an attempt with no handshake by then (a SYN dropped by
    a server's full accept queue, which the kernel would resend only after 1, 3, 7, 15 ... s) is retried at once
    on a fresh socket, until connect_timeout_s."""
    max_connecting_per_server: int | None = Field(default=1024, ge=1)
    """Connections to one server opened but not yet heard from (a new connection's first request asks for
    `100 Continue`, which the server sends once it accepted it). Held below the server's listen backlog (SGLang:
    2048, capped by the kernel's somaxconn), so thousands of episodes starting at once never overflow its accept
    queue (the kernel drops SYNs then, and requests stall for tens of seconds); high enough that a busy server's
    slow first answers do not hold requests back (128 held some of 10,000 single-turn episodes 10 s on an H200).
    null: no pacing."""
    retry_budget_s: float = Field(default=900.0, gt=0)
    """Total wall time one generate() call may spend across all of its attempts."""
    max_attempts: int = Field(default=5, ge=1)
    """Attempts per generate() call (the first one included)."""
    retry_backoff_s: float = Field(default=0.2, ge=0)
    """Base of the exponential backoff between attempts (capped at 5 s)."""
    eject_after_failures: int = Field(default=2, ge=1)
    """Consecutive failed requests or health checks after which a server is ejected."""
    health_interval_s: float = Field(default=2.0, gt=0)
    """Period of /health probes; ejected servers that answer again are re-admitted."""
    health_timeout_s: float = Field(default=5.0, gt=0)
    """Timeout of one /health probe."""
    answered_grace_s: float = Field(default=30.0, ge=0)
    """A failed health probe does not count against a server that answered a request this recently (or,
    before its first answer, within this long of the manager's start): under heavy load SGLang's /health
    can miss its timeout while the server works fine."""
    keepalive_s: float = Field(default=3.0, gt=0)
    """How long an idle pooled connection is kept for reuse. Below the server's own keep-alive (SGLang's
    uvicorn closes idle connections after 5 s, SGLANG_TIMEOUT_KEEP_ALIVE): otherwise a request sent just as
    the server closes the connection fails, which a synchronous run meets after every ~5 s learner step."""
    all_down_grace_s: float = Field(default=20.0, ge=0)
    """How long a request waits for any server to come back before the run is declared dead."""
    admin_timeout_s: float = Field(default=120.0, gt=0)
    """Timeout of admin calls (pause, flush, weight updates) to each server."""
    flush_timeout_s: float = Field(default=60.0, ge=0)
    """How long a /flush_cache the server refuses is retried (back-off 0.05 s doubling to 1 s). SGLang refuses a
    flush until its scheduler is fully idle, which it is not for a moment after its last request ends; a
    refusal never counts as the server's failure. Past this: a bench goes on with the cache kept (said), a
    weight update ejects the server until resynced (its cache holds the old weights' KV)."""
    concurrency: ConcurrencyConfig = Field(default_factory=ConcurrencyConfig)
    """Requests in flight per server that follow what the server reports (manager.concurrency.adaptive)."""


class SamplingConfig(Section):
    temperature: float = Field(default=1.0, ge=0)
    """Sampling temperature; 0 is greedy (eval only). In training it is also the learner's temperature
    (its logits are divided by it), and it must be > 0."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling mass. Training refuses < 1 unless train.accept_biased_ratios (see there)."""
    top_k: int = Field(default=-1, ge=-1)
    """Top-k sampling; -1 disables it. Training refuses > 0 unless train.accept_biased_ratios."""
    min_p: float = Field(default=0.0, ge=0, le=1)
    """Min-p sampling threshold; 0 disables it. Training refuses > 0 unless train.accept_biased_ratios."""
    max_new_tokens: int = Field(default=64, ge=1)
    """Max tokens generated per episode (single-turn) or per call."""
    stop: list[str] = Field(default_factory=list)
    """Extra stop strings (the server checks them; the returned ids are still exact)."""
    stop_token_ids: list[int] = Field(default_factory=list)
    """Extra stop token ids besides the tokenizer's EOS."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks only)."""


class DataConfig(Section):
    """The rows of a run, one section for `agentloop rollout` and `agentloop train` (training and validation)."""

    path: str | None = None
    """JSONL or Parquet file of verl-format rows (`--data`): the rows rolled out, or trained on. None: the
    built-in set named by `builtin`."""
    builtin: str = "arithmetic"
    """Built-in set used when `path` is None."""
    max_samples: int | None = Field(default=None, ge=1)
    """Use only the first N rows of `path` / `builtin` (in training: before the held-out slice is taken)."""
    prompt_key: str = "prompt"
    """Column holding the chat messages (data files, training and validation ones too; built-in sets use `prompt`)."""
    apply_chat_template: bool = True
    """False: the prompt is the row's single message's text, tokenized as is (no chat template), as
    TinyZero does: its countdown prompts carry their own `Assistant:` / `<|im_start|>` markup."""
    val_path: str | None = None
    """Training: JSONL or Parquet file of validation rows (`--val-data`)."""
    val_builtin: str | None = None
    """Training: built-in validation set, used when `val_path` is None and the training rows are a built-in
    set too (`path` None): a run on a data file never validates on a built-in set (the resolved config
    then holds None here)."""
    val_max_samples: int | None = Field(default=32, ge=1)
    """Training: validate on the first N rows of `val_path` / `val_builtin` (one episode each; None: all)."""
    val_holdout: int | None = Field(default=None, ge=0)
    """Training without `val_path` (and without `val_builtin` for a built-in training set): validate on this
    many rows held out of the training rows and never trained on, spread evenly over them (row
    floor(i * rows / N) for i < N: the same rows every run). None: min(32, rows // 10); the resolved
    number is saved in the run's config.yaml. 0: no validation. With `train.val_every=0` nothing is held out
    unless a number is set here (a resumed run keeps its training rows when validation is turned off)."""


class RolloutConfig(Section):
    loop: str = "single_turn_agent_loop"
    """Registered agent loop to run."""
    n_samples: int = Field(default=4, ge=1)
    """Episodes per prompt (repeats); pass@k is reported for k up to this."""
    max_concurrency: int = Field(default=512, ge=1)
    """Episodes in flight at once in this process."""
    episode_timeout_s: float = Field(default=1800.0, gt=0)
    """Wall-time limit of one episode; past it the episode becomes an error record."""
    max_error_rate: float = Field(default=0.5, ge=0, le=1)
    """`agentloop rollout` exits 1 (naming the error kinds) when more than this share of its episodes are error
    records; 1.0 never fails on errors."""
    cancel_timeout_s: float = Field(default=60.0, gt=0)
    """How long cancelling the groups in flight (the run's end, a stop) waits for their episodes to finish their
    clean-up (tool releases, agent processes); a group still running then is given up on, named in its outcome."""
    seed: int = 0
    """Run seed; each episode's sampling seed derives from (seed, the prompt's uid, repeat index, and the
    attempt when a prompt is given out again): the same row twice, or in a later epoch, gets fresh noise."""
    progress_interval_s: float = Field(default=2.0, gt=0)
    """Seconds between progress lines."""
    step_slice_ms: float = Field(default=5.0, gt=0)
    """Episode work one event-loop iteration may start, in milliseconds: episode starts and the steps after
    each server answer (parse, tools, the next request) beyond it wait for the next iteration, in arrival
    order, so timers, health probes and I/O are never starved when thousands of episodes move at once
    (agentloop.util.pacing). Lower: less loop lag; the lag p99 stays near this plus one step."""


class RewardConfig(Section):
    custom: str | None = None
    """`path/to/file.py:function` or `package.module:function` scoring every episode instead of the registry."""
    default: str | None = None
    """Registered reward used for data sources that have no reward of their own (None: error)."""
    custom_view: Literal["response", "prompt_response", "loop"] = "response"
    """The text `custom` receives as solution_str. response: the response decoded without special tokens
    (what verl's reward manager passes a custom compute_score); prompt_response: prompt + response with
    special tokens (TinyZero's and Search-R1's reward managers); loop: the loop's own response text."""
    timeout_s: float = Field(default=60.0, gt=0)
    """Wall-clock limit of one reward call: a synchronous function from when a worker takes it, an async one
    for its whole await (not the code reward, which has its own deadlines in `reward.code`). Past it the
    episode scores `failure_score` (counted as `reward_timeouts`) and a process worker is killed and replaced."""
    failure_score: float = 0.0
    """Score of an episode whose reward raised, returned something unusable or ran past `timeout_s`
    (counted as `reward_errors` / `reward_timeouts`): the lowest score your reward gives (0.0 for the
    built-ins), so training treats a rejected output as the worst answer."""
    workers: int = Field(default=4, ge=1)
    """Processes (or threads) that run synchronous reward functions off the event loop."""
    executor: Literal["process", "thread"] = "process"
    """process: synchronous rewards run in worker processes (a looping one is killed at the deadline); a
    reward a fresh process cannot import (a closure, lambda or object) runs on a thread, said once. thread:
    every one runs on a thread (no start-up cost; a call past the deadline cannot be stopped)."""
    code: CodeRewardConfig = Field(default_factory=CodeRewardConfig)
    """Code reward (agentloop/code): pass_rate or all_or_nothing, time limits."""
    tools: ToolRewardConfig = Field(default_factory=ToolRewardConfig)
    """How tool_agent_loop's excess-call penalty and tool rewards enter the reward."""


class TrainConfig(Section):
    steps: int = Field(default=20, ge=1)
    """RL steps (rollout -> learner update -> weight push) to run."""
    prompts_per_step: int = Field(default=16, ge=1)
    """Prompts per step; each is rolled out `rollout.n_samples` times (the GRPO group)."""
    val_every: int = Field(default=5, ge=0)
    """Validate every N steps (and before the first and after the last step); 0 disables validation. The
    rows (training and validation) come from the `data` section."""
    warm_start: bool = True
    """With the built-in tiny model (model.path null), start from its supervised warm start on
    synthetic calculator traces, so RL has something to improve: it calls the calculator on about
    half the prompts at temperature 1. The SFT takes ~100 s on a GPU and hours on 2 CPU cores, so its
    GPU-built weights ship in the package and are installed into the cache (see agentloop.models.warmstart)."""
    schedule: Literal["sync", "async"] = "async"
    """The one "async" of the config (module doc). async: rollouts never stop for the learner; a producer keeps
    groups in flight under the admission rule, the learner trains as soon as `prompts_per_step` eligible groups
    are ready, and `max_staleness` bounds how old a trained token's weights may be (0 reproduces the synchronous
    schedule exactly).
    sync: the plain loop (roll out a step, train, push), kept as the reference the async one is tested against."""
    max_staleness: int = Field(default=1, ge=0)
    """η: a token trained at step s was sampled by weights at most η versions older than the weights step s
    starts from (version s-1). 1 (default): one batch more in flight, so rollouts go on while the learner
    trains, and the learner corrects for the lag (decoupled PPO with the recomputed proximal policy,
    `algo.tis_cap`). 0: synchronous, on-policy (the same run as schedule=sync). Groups that grow too
    stale are cancelled early (counted) and their prompts given out again."""
    interrupt: Literal["abort", "retract", "in_place"] = "abort"
    """How in-flight generation meets a weight update (SGLang's pause modes), with every weight sync (disk,
    tensor, nccl; agentloop/interrupt.py). abort: requests return their partial tokens and are continued
    (prompt + partial, remaining budget) under the new weights, every token's version exact; the update
    flushes the prefix cache. retract: the server requeues them and re-prefills under the new weights on
    resume (per-token versions from the server's spans where it reports them); the cache is flushed right
    after the update (where a server refuses that with requests waiting, SGLang 0.5.17, they are aborted and
    continued as in abort). in_place: requests keep their KV from the old weights (fastest, most stale);
    nothing is flushed, and each request's prefix-cache key carries its weight version, so no request of
    version v+1 reuses a prefix cached under v."""
    max_version_violations: float = Field(default=0.0, ge=0, le=1)
    """Share of a step's trained records allowed to hold tokens of versions outside the schedule's
    window [s-1-η, s-1]; past it the step fails (a server serving the wrong weights)."""
    server_logprob_tol: float | None = Field(default=0.1, gt=0)
    """Before step 1 of a fresh run, each server's log-probs of a fixed token sequence are compared with the
    learner's first forward of it (at temperature 1); a server whose mean |difference| is above this serves
    another model (or other weights) than the learner trains, and the run refuses to start, naming it. This is
    what checks servers on another host (--server-url) beyond their model type and architecture. None: skip."""
    learner_ready_timeout_s: float = Field(default=600.0, gt=0)
    """Deadline for the learner process to load its model and report ready."""
    update_timeout_s: float = Field(default=3600.0, gt=0)
    """Deadline for one learner update (from batch submitted to weights saved), and for the learner's
    final save at the end of the run (HF weights and checkpoint of the last step)."""
    tensorboard: bool = True
    """Also write TensorBoard event files (when the tensorboard package is installed)."""
    wandb_project: str | None = None
    """Also log every step's metrics to Weights & Biases under this project (needs `pip install
    wandb`; WANDB_MODE=offline works without an account). None: off."""
    wandb_run_name: str | None = None
    """W&B run name (default: the run directory's name); a resumed run continues the same W&B run."""
    resume: bool = True
    """Continue from the learner's last checkpoint in run_dir when there is one."""
    accept_biased_ratios: bool = False
    """Train although sampling.top_p < 1, top_k > 0 or min_p > 0. The server's logprobs are those of the
    full tempered softmax, not of the truncated distribution that actually sampled, so every PPO ratio,
    TIS weight and KL estimate is then computed against the wrong behaviour policy. Off: such a
    sampling config is an error in training."""


class ClusterConfig(Section):
    """Where `agentloop train` runs its servers and learner (docs/cluster.md), and the GPUs it plans
    its memory for (agentloop.train.planning.memory)."""

    gpu_memory_gib: float | None = Field(default=None, gt=0)
    """Plan for GPUs of this size (GiB each, e.g. 80 for an H100), also on a machine without a GPU
    (`agentloop train --dry-run` on a CPU box). None: the visible GPUs, by their free memory at start."""
    num_gpus: int | None = Field(default=None, ge=1)
    """Plan for this many GPUs. None: the visible ones (1 when gpu_memory_gib is set and none is visible)."""

    backend: Literal["local", "ray"] = "local"
    """local: servers and learner on this host (or the learner over several hosts with torchrun's rendezvous,
    `learner.nnodes`). ray: every SGLang server a Ray actor holding its GPUs, the learner's ranks Ray actors in a
    placement group forming their torch.distributed group themselves; batches and control travel through Ray
    (needs `pip install 'agentloop[ray]'`)."""
    address: str | None = None
    """backend ray: the running Ray cluster to join (`host:6379`, `auto`, or `ray://host:10001`); None: a local
    Ray instance started for the run (and stopped after it)."""
    shared_fs: bool = False
    """backend ray: every node sees the run dir and the learner's directory at the same path (a shared filesystem),
    so servers load the learner's HF weights from it directly. False: no shared filesystem is assumed, each HF
    weights directory the servers load (weight_sync disk, a resume, a resync) travels through Ray's object store
    to every server's node, into that node's temp dir."""
    learner_dir: str | None = None
    """backend ray: where the learner's ranks keep weights/, checkpoints/ and their logs: a path every learner
    node reaches (a shared filesystem mount when the ranks span nodes); resume and the final model live here.
    None: the run dir (one host, or a shared filesystem)."""
    server_resources: dict[str, float] = Field(default_factory=dict)
    """backend ray: custom Ray resources each server actor requires, to place servers on given nodes (e.g.
    {"inference": 1} with `ray start --resources='{"inference": 8}'` on those nodes)."""
    learner_resources: dict[str, float] = Field(default_factory=dict)
    """backend ray: custom Ray resources each learner rank's placement-group bundle requires."""
    server_gpus: float | None = Field(default=None, ge=0)
    """backend ray: GPUs each server actor holds (a fraction, e.g. 0.5, to share a GPU with a learner rank:
    `colocate`). None: 1 with CUDA servers, 0 on CPU."""
    learner_gpus: float | None = Field(default=None, ge=0)
    """backend ray: GPUs each learner rank holds. None: 1 with a CUDA learner (0.5 when `colocate`), 0 on CPU."""
    colocate: bool = False
    """backend ray: server i and learner rank i share rank i's placement-group bundle (its GPU); each holds
    `server_gpus` / `learner_gpus` of it (default 0.5 each). Needed for learner.weight_sync=tensor (CUDA IPC
    works only between processes on one GPU's host)."""
    placement: Literal["pack", "spread"] = "pack"
    """backend ray: the learner ranks' placement group strategy (pack: as few nodes as fit; spread: one per node
    where possible)."""
    server_restarts: int = Field(default=1, ge=0)
    """backend ray: how often Ray restarts a server actor whose process or node died (it comes back at the same
    node and port; the run re-admits it only once it serves the current weights, as any server)."""
    cpus_per_actor: float = Field(default=1.0, ge=0)
    """backend ray: CPUs each server actor, learner rank and rollout worker reserves."""
    rollout_workers: int = Field(default=0, ge=0)
    """backend ray: rollout worker actors (engine processes, each with its own event loop and ServerManager over
    the run's servers) that run the asynchronous schedule's episodes, so they are not bound to the driver's event
    loop; the driver keeps the schedule and makes every admin call, telling the workers' managers first. 0: the
    episodes run on the driver. (train.schedule=sync and validation always run on the driver.)"""


class Config(Section):
    name: str = "agentloop"
    """Run name; the run directory is `<runs_dir>/<name>-<timestamp>`."""
    runs_dir: str = "runs"
    """Parent directory of run directories."""
    run_dir: str | None = None
    """Exact run directory (overrides runs_dir/name)."""
    plugins: list[str] = Field(default_factory=list)
    """Python files or modules imported at start-up (they register loops, tools, rewards)."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """Model and tokenizer."""
    server: ServerConfig = Field(default_factory=ServerConfig)
    """Inference servers."""
    manager: ManagerConfig = Field(default_factory=ManagerConfig)
    """Server manager (routing, retries, health)."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Sampling settings."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Data source."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Rollout settings."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """Reward selection."""
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    """Tools, tool-call parsing and the tool loop's limits."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """The RL loop (`agentloop train`)."""
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    """What the learner optimises (advantages, PPO loss, KL, entropy)."""
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    """How the learner runs (optimizer, schedule, micro-batches, ranks, checkpoints)."""
    agent: AgentConfig = Field(default_factory=AgentConfig)
    """Your own agent, run by openai_agent_loop (entry function or command) against the gateway."""
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    """The OpenAI/Anthropic-compatible HTTP gateway openai_agent_loop serves agents through."""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """Where a training run's servers and learner run (this host, or a Ray cluster) and the GPUs it plans its
    memory for (None: the visible ones)."""
    envs: EnvsConfig = Field(default_factory=EnvsConfig)
    """Environment libraries' environments (verifiers, reasoning-gym, TextArena, OpenEnv): `--env LIB:SPEC`."""
    journal: JournalConfig = Field(default_factory=JournalConfig)
    """The episode journal of `agentloop train` (RUN_DIR/journal/): a killed run continues every episode where it
    stood."""

    @model_validator(mode="after")
    def _cross_checks(self) -> "Config":
        if not self.server.urls and self.server.num_local == 0:
            raise ValueError("no servers: set server.urls or server.num_local >= 1")
        if self.rollout.loop == "openai_agent_loop" and not (self.agent.entry or self.agent.command):
            raise ValueError("rollout.loop=openai_agent_loop runs your agent: set agent.entry=path.py:fn "
                             "or agent.command=\"...\"")
        return self


RAY_ONLY = frozenset({"address", "shared_fs", "learner_dir", "server_resources", "learner_resources", "server_gpus",
                      "learner_gpus", "colocate", "placement", "server_restarts", "cpus_per_actor",
                      "rollout_workers"})
"""The cluster keys that mean something only with cluster.backend=ray."""


def _cluster_problems(cfg: Config) -> list[str]:
    """Combinations of cluster, server and learner settings that cannot work (each with what to do instead)."""
    c, ws, out = cfg.cluster, cfg.learner.weight_sync, []
    if c.backend == "local":
        default = ClusterConfig()  # a resolved config (config.yaml) names every key: compare values
        set_here = sorted(k for k in RAY_ONLY if getattr(c, k) != getattr(default, k))
        if set_here:
            out.append(f"cluster.{', cluster.'.join(set_here)} only apply to cluster.backend=ray")
        if cfg.learner.nnodes > 1 and ws == "tensor":
            out.append("learner.nnodes > 1 with learner.weight_sync=tensor: CUDA IPC needs the servers on the "
                       "learner's host; use nccl (or disk, on the shared filesystem the run dir is on)")
        return out
    if cfg.learner.nnodes > 1:
        out.append("learner.nnodes > 1 is torchrun's own rendezvous (cluster.backend=local); with cluster.backend=ray "
                   "the learner ranks are Ray actors placed by Ray: set learner.ranks only")
    if ws == "tensor" and not c.colocate:
        out.append("learner.weight_sync=tensor with cluster.backend=ray needs cluster.colocate=true: CUDA IPC works "
                   "only between a learner rank and servers on its GPU; use nccl for servers elsewhere")
    if c.colocate and cfg.server.urls:
        out.append("cluster.colocate places Ray server actors next to the learner ranks; server.urls servers are "
                   "not Ray's to place")
    share = (0.5 if c.server_gpus is None else c.server_gpus) + (0.5 if c.learner_gpus is None else c.learner_gpus)
    if c.colocate and share > 1:
        out.append(f"cluster.colocate: a server and a learner rank share one GPU, but cluster.server_gpus + "
                   f"cluster.learner_gpus = {share:g} > 1; give them fractions that sum to at most 1 (e.g. 0.5 each)")
    if c.colocate and not cfg.server.urls and cfg.server.num_local > cfg.learner.world_size:
        out.append(f"cluster.colocate puts server i on learner rank i's GPU: server.num_local="
                   f"{cfg.server.num_local} > learner.ranks={cfg.learner.world_size}")
    if cfg.server.urls and ws == "disk" and not c.shared_fs:
        out.append("server.urls with cluster.backend=ray and learner.weight_sync=disk: servers given by URL read the "
                   "learner's weights from their own filesystem; set cluster.shared_fs=true (a shared filesystem) "
                   "or use learner.weight_sync=nccl")
    if cfg.server.device == "cpu" and ws != "disk":
        out.append(f"learner.weight_sync={ws} needs CUDA servers; CPU servers load weights from disk")
    return out


def lent_server_indices(cfg: Config) -> list[int]:
    """The servers that sleep while the learner trains (server.lend_learner_gpus; [] when off): server.lent_servers,
    else the local servers placed on one of learner.gpus."""
    sv = cfg.server
    if not sv.lend_learner_gpus:
        return []
    if sv.lent_servers is not None:
        return sorted(set(sv.lent_servers))
    if sv.urls:
        return []
    gpus = sv.gpus if sv.gpus is not None else list(range(sv.num_local))
    learner = set(cfg.learner.gpus if cfg.learner.gpus is not None else range(cfg.learner.world_size))
    return [i for i, g in enumerate(gpus) if g in learner]


def _lend_problems(cfg: Config) -> list[str]:
    sv, out = cfg.server, []
    if not sv.lend_learner_gpus:
        return out
    n = len(sv.urls) or sv.num_local
    if sv.urls and sv.lent_servers is None:
        out.append("server.lend_learner_gpus with server.urls needs server.lent_servers: the indices of the servers "
                   "that run on the learner's GPUs (agentloop cannot tell where servers it did not launch run)")
    elif any(i < 0 or i >= n for i in sv.lent_servers or []):
        out.append(f"server.lent_servers={sv.lent_servers} names servers outside the {n} server(s)")
    elif not lent_server_indices(cfg):
        out.append(f"server.lend_learner_gpus: no server runs on a learner GPU (server.gpus={sv.gpus}, learner.gpus="
                   f"{cfg.learner.gpus}): place one there (e.g. server.num_local=2 server.gpus=[0,1] "
                   "learner.gpus=[1]) or name them in server.lent_servers")
    if cfg.cluster.backend == "ray":
        out.append("server.lend_learner_gpus is not supported with cluster.backend=ray yet (the driver's "
                   "ServerManager makes the calls, the rollout workers' managers would not route away)")
    return out


def validate_for_training(cfg: Config) -> Config:
    """Check the rules that hold only when the rollouts train a policy, and make `sampling.temperature`
    the learner's temperature (`algo.temperature`). Raises ConfigError naming every broken rule.

    SGLang returns log_softmax(logits / T) over the full vocabulary for sampled tokens (greedy: untempered
    logits), and top_p/top_k/min_p only shape what is sampled, not the logprobs it returns. So the learner
    must divide its logits by the very T the servers sampled with, T must be > 0, and truncated sampling
    makes the recorded logprobs those of a distribution that did not sample. `agentloop rollout` (eval)
    does not call this: any sampling is fine there. Called by `agentloop train` and the learner process.
    """
    s, problems = cfg.sampling, []
    if s.temperature <= 0:
        problems.append("sampling.temperature=0 (greedy) cannot train: greedy sampling has no policy ratio, and "
                        "SGLang returns untempered logprobs for it; set sampling.temperature > 0")
    if "temperature" in cfg.algo.model_fields_set and cfg.algo.temperature != s.temperature:
        problems.append(f"algo.temperature={cfg.algo.temperature:g} differs from sampling.temperature="
                        f"{s.temperature:g}: the learner must divide its logits by the temperature the rollouts "
                        "were sampled at; set sampling.temperature only (algo.temperature follows it)")
    truncated = [f"{k}={v}" for k, v, on in (("sampling.top_p", s.top_p, s.top_p < 1),
                                              ("sampling.top_k", s.top_k, s.top_k > 0),
                                              ("sampling.min_p", s.min_p, s.min_p > 0)) if on]
    if cfg.server.urls and not cfg.model.path:
        problems.append("server.urls (--server-url) is set but model.path (--model) is not: the learner would train "
                        "the built-in tiny model while the servers serve whatever they were started with; pass "
                        "--model DIR, the Hugging Face directory the servers were started with")
    problems += _cluster_problems(cfg)
    problems += _lend_problems(cfg)
    if cfg.rollout.n_samples == 1 and cfg.algo.estimator in ("grpo", "rloo"):
        problems.append(f"rollout.n_samples=1 with algo.estimator={cfg.algo.estimator}: every group is one episode, "
                        "whose advantage is 0 here (no baseline; verl's grpo/rloo would use the raw score), so "
                        "nothing would be learned; use rollout.n_samples >= 2, or algo.estimator=reinforce_pp "
                        "(a batch-wide baseline) for one sample per prompt")
    if truncated and not cfg.train.accept_biased_ratios:
        problems.append(f"{', '.join(truncated)} truncates sampling, but the server's logprobs are those of the "
                        "full tempered softmax, so PPO ratios and TIS weights would be off; use the defaults "
                        "(top_p=1, top_k=-1, min_p=0) or set train.accept_biased_ratios=true to train anyway")
    if problems:
        raise ConfigError("config cannot be used for training:\n  " + "\n  ".join(problems))
    cfg.algo.temperature = s.temperature
    return cfg


class SamplingParams(SamplingConfig):
    """Typed sampling settings of one call, as a loop receives them; `seed` is the episode's seed."""

    seed: int | None = None
    """Sampling seed sent to the server (None: unseeded)."""

    def to_sglang(self, max_new_tokens: int | None = None) -> dict[str, Any]:
        """The `sampling_params` dict of SGLang's /generate."""
        d: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "max_new_tokens": max_new_tokens if max_new_tokens is not None else self.max_new_tokens,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        if self.stop:
            d["stop"] = list(self.stop)
        if self.stop_token_ids:
            d["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            d["sampling_seed"] = self.seed
        return d


def derive_seed(*parts: int | str) -> int:
    """A stable 31-bit seed from its parts (same parts, same seed, on every machine)."""
    h = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


# ---------------------------------------------------------------- loading


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    if not all(keys):
        raise ConfigError(f"bad override key {dotted!r}")
    node = tree
    for k in keys[:-1]:
        child = node.get(k)
        if child is None:
            child = node[k] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {k!r} is not a section")
        node = child
    node[keys[-1]] = value


def parse_override(arg: str) -> tuple[str, Any]:
    """`a.b=value` -> ("a.b", parsed value). Values are YAML: 3, 0.5, true, [1, 2], null."""
    if "=" not in arg:
        raise ConfigError(f"override {arg!r} is not of the form key.sub=value")
    key, raw = arg.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {arg!r}: value is not valid YAML ({e})") from None
    return key, value


def _format_validation(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"  {loc}: {msg} (got {e.get('input')!r})" if e["type"] != "extra_forbidden"
                     else f"  {loc}: {msg}")
    return "\n".join(lines)


MOVED_KEYS: dict[str, str] = {
    "train.data_path": "data.path (the --data flag)",
    "train.builtin": "data.builtin",
    "train.val_path": "data.val_path (the --val-data flag)",
    "train.val_builtin": "data.val_builtin",
    "train.val_max_samples": "data.val_max_samples",
    "train.sync": "learner.weight_sync (disk, tensor, nccl; train.sync could only say disk, the default)",
    "learner.nproc": "learner.ranks (all the learner's ranks: learner.nnodes x the ranks of one host under "
                     "torchrun, the rank actors under Ray)",
    "learner.checkpoint_async": "learner.checkpoint_background",
}
"""Keys that moved or were renamed (the training rows joined the one `data` section; train.sync, dead, went;
learner.nproc counted a host's ranks under torchrun but all of them under Ray; "async" is the schedule's word):
naming one is an error naming its replacement. A resumed run's own saved config is read with them migrated
(agentloop.train.orchestrator.resume)."""


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A YAML config file as a tree (ConfigError if it is missing, not YAML or not a mapping)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        loaded = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level")
    return loaded


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`key.sub=value` overrides set in `tree` (in place; returned)."""
    for arg in overrides:
        key, value = parse_override(arg)
        _set_path(tree, key, value)
    return tree


def config_from_tree(tree: dict[str, Any], source: str) -> Config:
    """Validate a config tree; ConfigError naming every bad or moved key, and `source`."""
    moved = [f"{old} is now {new}" for old, new in MOVED_KEYS.items()
             if isinstance(tree.get(old.split(".")[0]), dict) and old.split(".")[1] in tree[old.split(".")[0]]]
    if moved:
        raise ConfigError(f"invalid config ({source}): moved keys:\n  " + "\n  ".join(moved))
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_validation(e, source)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Build the config from an optional YAML file plus `key.sub=value` overrides."""
    tree: dict[str, Any] = read_config_file(path) if path is not None else {}
    source = str(path) if path is not None else "defaults"
    apply_overrides(tree, overrides or [])
    if overrides:
        source += " + overrides"
    return config_from_tree(tree, source)


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML (every field, defaults included)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
