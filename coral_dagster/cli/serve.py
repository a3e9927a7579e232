"""`coral serve …` (coordinator, scheduler, engine node, or all of them locally) and `coral generate`."""

from __future__ import annotations

import json
import socket
import sys
import threading
from typing import Any, Callable

import click
from click.core import ParameterSource

from coral_dagster.cli.types import NON_NEGATIVE, POSITIVE, FiniteFloat
from coral_dagster.errors import CoralError
from coral_dagster.runtime.protocol import Env

def _opt(*names: str, env: Env, **kw: Any):
    """A click option that can also be set from its `CORAL_*` variable (SkyPilot passes settings as env vars)."""
    return click.option(*names, envvar=env.value, show_envvar=True, **kw)


def _timing_options(f):
    from coral_dagster.runtime.config import Timing

    d = Timing()
    for name, env, default, text in reversed([
        ("--heartbeat-s", Env.HEARTBEAT_S, d.heartbeat_s, "Seconds between heartbeats."),
        ("--dead-after-s", Env.DEAD_AFTER_S, d.dead_after_s, "Silence after which a peer counts as dead."),
        ("--request-timeout-s", Env.REQUEST_TIMEOUT_S, d.request_timeout_s, "Longest a request may make no progress."),
        ("--request-deadline-s", Env.REQUEST_DEADLINE_S, d.request_deadline_s,
         "Longest a request may take in all (a client's timeout_s may shorten it)."),
        ("--kv-timeout-s", Env.KV_TIMEOUT_S, d.kv_timeout_s, "Longest a decode node waits for a KV handoff."),
        ("--orphan-after-s", Env.ORPHAN_AFTER_S, d.orphan_after_s, "Exit when the upstream is silent this long."),
    ]):
        f = _opt(name, env=env, type=POSITIVE, default=default, show_default=True, help=text)(f)
    return f


def _timing(kw: dict[str, Any]):
    from coral_dagster.runtime.config import Timing

    return Timing(**{k: kw.pop(k) for k in ("heartbeat_s", "dead_after_s", "request_timeout_s", "request_deadline_s",
                                            "kv_timeout_s", "orphan_after_s")})


_json = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
_insecure = _opt("--insecure", env=Env.INSECURE, is_flag=True,
                 help="Allow non-loopback sockets without CURVE (trusted networks only).")


def _role_options(f):
    """The flags every runtime process takes: --insecure, the timing knobs and --json."""
    return _insecure(_timing_options(_json(f)))


def _endpoint(name: str, env: Env, default: str, text: str):
    return _opt(name, env=env, default=default, show_default=True, help=text)


# vLLM's launch settings: flags of `coral serve engine`, and what `serve local --vllm-args` may carry.
_VLLM_FLAGS = [
    ("--tp", Env.TP, dict(type=int, default=1, show_default=True, help="Tensor-parallel GPUs in this node (vLLM).")),
    ("--max-model-len", Env.MAX_MODEL_LEN, dict(type=int, default=4096, show_default=True,
                                              help="vLLM: longest prompt + output.")),
    ("--gpu-memory-utilization", Env.GPU_MEMORY_UTILIZATION, dict(
        type=FiniteFloat(0.0, 1.0, low_open=True), default=0.9, show_default=True,
        help="vLLM: share of GPU memory for weights, activations and KV cache.")),
    ("--enforce-eager", Env.ENFORCE_EAGER, dict(is_flag=True, help="vLLM: no CUDA graphs or compilation.")),
    ("--kv-transfer-config", Env.KV_TRANSFER_CONFIG, dict(
        default="", help="vLLM: a PD instance's --kv-transfer-config JSON (templates/engines.py writes it).")),
]


def _vllm_options(f):
    for name, env, kw in reversed(_VLLM_FLAGS):
        f = _opt(name, env=env, **kw)(f)
    return f


_VLLM_ARGS = _vllm_options(click.Command("--vllm-args", add_help_option=False))


def _vllm_launch(text: str) -> dict[str, Any]:
    """The VllmLaunch fields `serve local --vllm-args '…'` sets (only the flags given; defaults elsewhere)."""
    try:
        ctx = _VLLM_ARGS.make_context("--vllm-args", text.split())
    except click.ClickException as exc:
        raise CoralError(f"--vllm-args {text!r}: {exc.format_message()}",
                         f"pass valid values of these flags only: {', '.join(n for n, _, _ in _VLLM_FLAGS)}") from None
    return {k: v for k, v in ctx.params.items() if ctx.get_parameter_source(k) is ParameterSource.COMMANDLINE}


def _local_kv_transfer(log_dir: str | None) -> dict[str, str]:
    """Each phase's `--kv-transfer-config` for vLLM PD instances on this machine: ExampleConnector, the connector
    that runs on every vLLM build (`templates/engines.py`), its KV files under the log folder (or a temporary one)."""
    import tempfile
    from pathlib import Path

    from coral_dagster.app.node import KV_ROLES, vllm_kv_transfer_config

    storage = str(Path(log_dir) / "kv") if log_dir else tempfile.mkdtemp(prefix="coral-kv-")
    return {phase: json.dumps(vllm_kv_transfer_config(phase, "ExampleConnector", engine_id=f"local-{phase}",
                                                      extra={"shared_storage_path": storage}),
                              separators=(",", ":"))
            for phase in KV_ROLES}


@click.group("serve", context_settings={"help_option_names": ["-h", "--help"]})
def serve() -> None:
    """Run the serving runtime: a coordinator, one scheduler per instance, one engine node per stage node.

    `coral serve local` starts a whole deployment on this machine; the other subcommands are what each
    cloud node runs (every flag can also come from a CORAL_* environment variable).
    """


@serve.command("coordinator")
@_endpoint("--listen", Env.LISTEN, "tcp://127.0.0.1:5555", "ZeroMQ endpoint for schedulers and clients.")
@_opt("--http-host", env=Env.HTTP_HOST, default="127.0.0.1", show_default=True, help="Front door host.")
@_opt("--http-port", env=Env.HTTP_PORT, type=click.IntRange(-1, 65535), default=8000, show_default=True,
      help="Front door port (OpenAI-compatible); -1 disables it.")
@_opt("--model", "models", env=Env.MODEL, multiple=True, help="Model names to list before instances register.")
@_opt("--max-retries", env=Env.MAX_RETRIES, type=int, default=1, show_default=True,
      help="Times a failed request resumes on another instance.")
@_opt("--api-key", env=Env.API_KEY, default=None, help="Key HTTP clients must send as 'Authorization: Bearer'.")
@_opt("--tls-certfile", env=Env.TLS_CERTFILE, default=None,
      help="PEM certificate (chain) to serve HTTPS with; needs --tls-keyfile.")
@_opt("--tls-keyfile", env=Env.TLS_KEYFILE, default=None, help="PEM private key of --tls-certfile.")
@_opt("--allowed-origins", env=Env.ALLOWED_ORIGINS, default="[]", show_default=True,
      help="Origins browsers may call the API from, a JSON list as vLLM's flag (e.g. '[\"https://app.example\"]').")
@_opt("--allowed-methods", env=Env.ALLOWED_METHODS, default='["*"]', show_default=True,
      help="Methods CORS allows, a JSON list.")
@_opt("--allowed-headers", env=Env.ALLOWED_HEADERS, default='["*"]', show_default=True,
      help="Headers CORS allows, a JSON list.")
@_opt("--admit", env=Env.ADMIT, default="",
      help="Requests/s admitted per model, bucket depth in requests, the plan's capacity bucket and the share of the "
           "requests sent admitted, 'model=rate[:depth[:peak_rate:peak_depth]][@share],…' (a plan under scarcity; "
           "with @share the first bucket counts requests, not seconds); the rest get 429 with Retry-After.")
@_role_options
def coordinator_cmd(listen: str, http_host: str, http_port: int, models: tuple[str, ...], max_retries: int,
                    api_key: str | None, tls_certfile: str | None, tls_keyfile: str | None, admit: str,
                    allowed_origins: str, allowed_methods: str, allowed_headers: str,
                    insecure: bool, as_json: bool, **kw: Any) -> None:
    """Route requests over ready instances by weighted round-robin and serve the HTTP front door.

    With CORAL_REGISTRATION_KEY in its environment (`coral serve keys`), an instance registers only with a proof of
    its own credential (CORAL_INSTANCE_CREDENTIAL on its scheduler); without it, instances are bound to their
    connections only.
    """
    from coral_dagster.runtime.config import CoordinatorConfig, parse_admit
    from coral_dagster.runtime.frontdoor import Cors
    from coral_dagster.runtime.roles import run_coordinator

    admit_req_s, admit_depth_req, admit_peak, admit_share = parse_admit(admit)
    run_coordinator(CoordinatorConfig(listen=listen, http_host=http_host,
                                      http_port=None if http_port < 0 else http_port, models=models,
                                      max_retries=max_retries, api_key=api_key, timing=_timing(kw),
                                      admit_req_s=admit_req_s, admit_depth_req=admit_depth_req,
                                      admit_peak=admit_peak, admit_share=admit_share,
                                      http_tls_certfile=tls_certfile,
                                      http_tls_keyfile=tls_keyfile,
                                      http_allowed_origins=Cors.parse("--allowed-origins", allowed_origins),
                                      http_allowed_methods=Cors.parse("--allowed-methods", allowed_methods),
                                      http_allowed_headers=Cors.parse("--allowed-headers", allowed_headers)),
                    insecure, as_json)


@serve.command("scheduler")
@_opt("--instance", env=Env.INSTANCE, required=True, help="This serving instance's name.")
@_opt("--model", env=Env.MODEL, required=True, help="Model the instance serves.")
@_opt("--phase", env=Env.PHASE, type=click.Choice(["aggregated", "prefill", "decode"]), default="aggregated",
      show_default=True, help="What the instance does.")
@_opt("--split", env=Env.SPLIT, required=True, help="Layers per stage, e.g. 3,5,4 (VLLM_PP_LAYER_PARTITION).")
@_endpoint("--coordinator", Env.COORDINATOR, "tcp://127.0.0.1:5555", "The coordinator's ZeroMQ endpoint.")
@_endpoint("--listen", Env.LISTEN, "tcp://127.0.0.1:5600", "ZeroMQ endpoint the engine nodes connect to.")
@_opt("--region", env=Env.REGION, default="local", show_default=True,
      help="The instance's cloud region; the router keeps a request's prefill and decode in one region.")
@_opt("--route-weight", env=Env.ROUTE_WEIGHT, type=NON_NEGATIVE, default=0.0, show_default=True,
      help="The plan's routing weight of this instance (share of its model's demand); 0: weigh by --tokens-per-s.")
@_opt("--tokens-per-s", env=Env.TOKENS_PER_S, type=POSITIVE, default=1.0, show_default=True,
      help="The template's throughput; the router's weight for this instance.")
@_role_options
def scheduler_cmd(instance: str, model: str, phase: str, split: str, coordinator: str, listen: str,
                  tokens_per_s: float, region: str, route_weight: float, insecure: bool, as_json: bool,
                  **kw: Any) -> None:
    """Admit this instance's engine nodes, register with the coordinator when ready, and drive requests.

    A coordinator holding a registration key needs this instance's credential in CORAL_INSTANCE_CREDENTIAL
    (`coral serve keys --credential INSTANCE`).

    The first SIGTERM drains (no new requests, finish those in flight, leave); a second one stops at once.
    """
    from coral_dagster.app.node import parse_split
    from coral_dagster.runtime.config import SchedulerConfig
    from coral_dagster.runtime.roles import model_layers, model_limits, run_scheduler

    run_scheduler(SchedulerConfig(instance=instance, model=model, phase=phase, split=parse_split(split),
                                  n_layers=model_layers(model), coordinator=coordinator, listen=listen,
                                  tokens_per_s=tokens_per_s, timing=_timing(kw), region=region,
                                  route_weight=route_weight, limits=model_limits(model)), insecure, as_json)


@serve.command("engine")
@_opt("--node", env=Env.NODE, default=None, help="This node's name (default: host name and stage).")
@_opt("--model", env=Env.MODEL, required=True, help="Model to load.")
@_opt("--layers", env=Env.LAYERS, required=True, help="Layer range start:end this node holds.")
@_opt("--stage-rank", env=Env.STAGE_RANK, type=int, required=True, help="Stage index in the instance.")
@_endpoint("--scheduler", Env.SCHEDULER, "tcp://127.0.0.1:5600", "The instance scheduler's ZeroMQ endpoint.")
@_endpoint("--listen", Env.LISTEN, "tcp://127.0.0.1:*",
           "ZeroMQ endpoint for activations and KV (port * = any free one).")
@_opt("--advertise", env=Env.ADVERTISE, default="", help="Address peers should use, if not the bound one.")
@_opt("--share", env=Env.SHARE, type=FiniteFloat(0.0, 1.0), default=1.0, show_default=True,
      help="This node's share of its stage.")
@_opt("--engine", "engine_kind", env=Env.ENGINE, type=click.Choice(["torch", "vllm"]), default="torch",
      show_default=True, help="Engine behind the node.")
@_opt("--split", env=Env.SPLIT, default="", help="The instance's layer split (vLLM engine only).")
@_opt("--device", env=Env.DEVICE, default=None, help="Torch device (default: cuda if present, else cpu).")
@_opt("--node-rank", env=Env.NODE_RANK, type=int, default=0, show_default=True,
      help="vLLM: this node's rank in the instance's pipeline; rank 0 serves, others run `vllm serve --headless`.")
@_endpoint("--vllm-head", Env.VLLM_HEAD, "127.0.0.1", "vLLM: the head node's address (vLLM's --master-addr).")
@_opt("--vllm-port", env=Env.VLLM_PORT, type=click.IntRange(1, 65535), default=29501, show_default=True,
      help="vLLM: the head's torch.distributed port (vLLM's --master-port).")
@_vllm_options
@_opt("--restart/--no-restart", env=Env.RESTART, default=True, show_default=True,
      help="Restart the node, with exponential back-off, when it fails (a clean stop or a configuration error ends "
           "the command with the node's status).")
@_role_options
def engine_cmd(node: str | None, model: str, layers: str, stage_rank: int, scheduler: str, listen: str,
               advertise: str, share: float, engine_kind: str, split: str, tp: int, device: str | None,
               node_rank: int, vllm_head: str, vllm_port: int, max_model_len: int, gpu_memory_utilization: float,
               enforce_eager: bool, kv_transfer_config: str, restart: bool, insecure: bool, as_json: bool,
               **kw: Any) -> None:
    """Hold layers [start, end) of the model, run batched forwards and pass activations to the next stage.

    With `--engine vllm` the node is the head of a vLLM pipeline over the instance's nodes (the whole model,
    `--split` per vLLM stage, tokens streamed); with `--node-rank` above 0 it becomes that pipeline's
    headless worker (`vllm serve … --headless`). The node runs as a child leading its own process group, as under
    `serve local`: that group (vLLM's engine core and workers) dies with the node and with this command.
    """
    from coral_dagster.app.node import parse_split
    from coral_dagster.runtime.config import NodeSettings, parse_layers
    from coral_dagster.runtime.groups import supervise
    from coral_dagster.runtime.roles import model_layers, run_engine, run_headless

    start, end = parse_layers(layers)
    split_t = parse_split(split) if split else ()
    launch = dict(tp=tp, master_addr=vllm_head, master_port=vllm_port, max_model_len=max_model_len,
                  gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
                  kv_transfer_config=kv_transfer_config)
    target: Callable[..., None]
    if engine_kind == "vllm" and node_rank > 0:
        name, target, kwargs = f"vllm rank {node_rank}", run_headless, dict(
            model=model, split=split_t, node_rank=node_rank, launch=launch)
    else:
        settings = NodeSettings(node=node or f"{socket.gethostname()}-s{stage_rank}", model=model, start=start,
                                end=end, n_layers=model_layers(model), stage=stage_rank, scheduler=scheduler,
                                listen=listen, advertise=advertise, share=share, engine=engine_kind, split=split_t,
                                tp=tp, timing=_timing(kw))
        name, target, kwargs = f"engine {settings.node}", run_engine, dict(
            settings=settings, device=device, launch=launch if engine_kind == "vllm" else None, insecure=insecure,
            as_json=as_json)
    sys.exit(supervise(name, target, kwargs, restart=restart))


@serve.command("endpoint")
@click.option("--upstream", "upstreams", multiple=True, required=True, metavar="URL",
              help="A coordinator's front door, http(s)://host:port; the first is the primary, the next ones its "
                   "standbys (repeat the option).")
@_opt("--host", env=Env.HTTP_HOST, default="127.0.0.1", show_default=True, help="Address the endpoint listens on.")
@_opt("--port", env=Env.HTTP_PORT, type=click.IntRange(1, 65535), default=8000, show_default=True,
      help="Port the endpoint listens on (the one URL clients call).")
@click.option("--tls-pemfile", type=click.Path(dir_okay=False), default=None,
              help="PEM holding the certificate chain and its private key: serve HTTPS (else plain HTTP).")
@click.option("--config-dir", type=click.Path(file_okay=False), default=".", show_default=True,
              help="Where HAProxy's configuration is written (haproxy.cfg, mode 0600).")
def endpoint_cmd(upstreams: tuple[str, ...], host: str, port: int, tls_pemfile: str | None, config_dir: str) -> None:
    """One public endpoint in front of the coordinator pair: HAProxy sends every request to the primary while it
    answers its health check (/ping, every 0.5 s) and to the standby once it does not.

    A request is retried on the other coordinator only when its connection failed before anything was sent, so
    none is answered twice; streamed responses pass through unbuffered. Needs HAProxy (Debian/Ubuntu: `apt-get
    install haproxy`); this command becomes HAProxy in the foreground.
    """
    from pathlib import Path

    from coral_dagster.runtime.endpoint import run_endpoint

    run_endpoint(upstreams, host, port, Path(config_dir), Path(tls_pemfile) if tls_pemfile else None)


@serve.command("local")
@click.option("--model", default="tiny-llama", show_default=True, help="Runtime model.")
@click.option("--engine", "engine_kind", type=click.Choice(["torch", "vllm"]), default="torch", show_default=True,
              help="torch: Coral's stages as separate processes; vllm: one vLLM pipeline per instance.")
@click.option("--split", default=None, help="Layers per stage (torch default 3,5,4; vllm default one stage).")
@click.option("--instances", type=int, default=2, show_default=True,
              help="Instances; with --pd half (rounded up) prefill, the rest decode.")
@click.option("--pd", is_flag=True, help="Disaggregate prefill and decode, handing KV over node to node (vLLM: "
                                         "through its ExampleConnector, files under the log folder).")
@click.option("--decode-split", default=None, help="Layers per stage of decode instances (default: --split).")
@click.option("--stage-nodes", default=None,
              help="Engine nodes per stage, e.g. 1,2,1 (default one each; decode instances with their own split "
                   "get one each).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="HTTP front door port.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address every process listens on.")
@_opt("--api-key", env=Env.API_KEY, default=None,
      help="Key HTTP clients must send as 'Authorization: Bearer' (default: generated, written to <log-dir>/api_key).")
@click.option("--restart/--no-restart", default=True, show_default=True,
              help="Restart a scheduler or engine that dies, with exponential back-off.")
@click.option("--endpoint", is_flag=True,
              help="Run the coordinator pair as `coral launch` deploys it: each on ports of its own, with HAProxy "
                   "(`coral serve endpoint`) on --port in front.")
@click.option("--log-dir", type=click.Path(file_okay=False), default=None, help="Where each process logs.")
@click.option("--ready-timeout-s", type=POSITIVE, default=120.0, show_default=True, help="Start-up time limit.")
@click.option("--vllm-args", default="", help="vLLM heads' launch flags of `coral serve engine`, e.g. "
              "'--gpu-memory-utilization 0.05 --max-model-len 512' (also --tp, --enforce-eager).")
@_timing_options
@_json
def local_cmd(model: str, engine_kind: str, split: str | None, instances: int, pd: bool, decode_split: str | None,
              stage_nodes: str | None, port: int, host: str, api_key: str | None, restart: bool, endpoint: bool,
              log_dir: str | None, ready_timeout_s: float, vllm_args: str, as_json: bool, **kw: Any) -> None:
    """Start coordinator, schedulers and engine nodes as separate processes here; stop with Ctrl-C.

    Every socket between them is CURVE-encrypted with keys generated for this run; the HTTP front door needs the
    API key, which is printed as a file path (the key itself is never printed). Each process leads its own
    process group, which dies with it and with this command.
    """
    from pathlib import Path

    from coral_dagster.app.node import parse_split
    from coral_dagster.runtime.local import LocalDeployment, local_instances
    from coral_dagster.runtime.roles import model_layers, say, stop_on_signals

    if engine_kind == "vllm" and stage_nodes:
        raise CoralError("a vLLM instance runs one node per stage.", "drop --stage-nodes with --engine vllm")
    split = split or (str(model_layers(model)) if engine_kind == "vllm" else "3,5,4")
    try:
        nodes = parse_split(stage_nodes) if stage_nodes else ()
    except CoralError:
        raise CoralError(f"--stage-nodes {stage_nodes!r} is not a list of positive node counts.",
                         "give engine nodes per stage as 'a,b,c', one per stage of --split, e.g. 1,2,1") from None
    layout = local_instances(parse_split(split), instances, pd, parse_split(decode_split) if decode_split else None,
                             nodes)
    dep = LocalDeployment(model, layout, host=host, http_port=port, timing=_timing(kw),
                          log_dir=Path(log_dir) if log_dir else None, api_key=api_key, restart=restart,
                          standby=True, endpoint=endpoint, engine=engine_kind,
                          vllm_launch=_vllm_launch(vllm_args),
                          kv_transfer=_local_kv_transfer(log_dir) if engine_kind == "vllm" and pd else {})
    stop = threading.Event()
    stop_on_signals(stop)
    try:
        dep.start()
        dep.wait_ready(ready_timeout_s)
        info = dep.info()
        say(as_json, {"ready": True, **info},
            f"serving {model} at {info['http']}/v1 ({len(layout)} instances; logs in {info['log_dir']}; "
            f"API key in {info['api_key_file']})")
        while not stop.wait(0.5):
            if not dep.alive("coordinator"):
                raise CoralError(f"the coordinator exited; logs in {info['log_dir']}.", "read coordinator.log")
    finally:
        dep.stop()


@serve.command("keys")
@click.option("--credential", "instance", metavar="INSTANCE", default=None,
              help="Print instead the credential of instance INSTANCE, derived from $CORAL_REGISTRATION_KEY (what "
                   "`coral launch` gives that instance's scheduler as CORAL_INSTANCE_CREDENTIAL).")
@click.option("--node", metavar="NODE", default=None,
              help="With --credential: print instead the credential of engine node NODE of that instance (what "
                   "`coral launch` gives the node as CORAL_NODE_CREDENTIAL).")
@click.option("--stage", type=click.IntRange(min=0), default=0, show_default=True,
              help="With --node: the stage the node holds (its CORAL_STAGE_RANK).")
@_json
def keys_cmd(instance: str | None, node: str | None, stage: int, as_json: bool) -> None:
    """Generate a deployment's keys: the CURVE keypair every node gets, and the registration key only the coordinator
    and the launching machine hold (each instance gets a credential derived from it for its own name, and each engine
    node one for its instance, stage and name). Pass them as
    SkyPilot secrets; `coral launch` reads them from this shell."""
    from coral_dagster.runtime import credentials
    from coral_dagster.runtime.protocol import Env
    from coral_dagster.runtime.security import CurveKeys

    if instance is not None:
        key = credentials.from_env(Env.REGISTRATION_KEY)
        if not key:
            raise CoralError(f"{Env.REGISTRATION_KEY} is not set in this shell.",
                             f"export the {Env.REGISTRATION_KEY} that `coral serve keys` printed for this deployment")
        env = ({Env.NODE_CREDENTIAL.value: credentials.node_credential_of(key, instance, stage, node)} if node
               else {Env.INSTANCE_CREDENTIAL.value: credentials.instance_credential(key, instance)})
        click.echo(json.dumps(env) if as_json else next(iter(env.values())))
        return
    if node is not None:
        raise CoralError("--node names a node of the instance that --credential names.",
                         "pass --credential INSTANCE --node NODE --stage S")
    env = {**CurveKeys.generate().env(), Env.REGISTRATION_KEY.value: credentials.generate()}
    click.echo(json.dumps(env) if as_json else "\n".join(f"{k}={v}" for k, v in env.items()))


@click.command("generate", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", default="tiny-llama", show_default=True, help="Runtime model.")
@click.option("--prompt", required=True, help="Prompt text.")
@click.option("--greedy/--no-greedy", default=True, show_default=True,
              help="Greedy decoding; --no-greedy samples at --temperature (seeded by --seed).")
@click.option("--temperature", type=NON_NEGATIVE, default=1.0, show_default=True,
              help="Sampling temperature (--no-greedy).")
@click.option("--top-p", type=FiniteFloat(0.0, 1.0, low_open=True), default=1.0, show_default=True,
              help="Nucleus mass kept (--no-greedy).")
@click.option("--top-k", type=int, default=0, show_default=True, help="Most likely tokens kept; 0 keeps all.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the draws (--no-greedy).")
@click.option("--max-tokens", type=int, default=16, show_default=True, help="Most tokens to generate.")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past EOS.")
@_json
def generate(model: str, prompt: str, greedy: bool, temperature: float, top_p: float, top_k: int, seed: int,
             max_tokens: int, ignore_eos: bool, as_json: bool) -> None:
    """Complete a prompt in this process: the reference `coral serve` must match token for token (sampled
    completions too: each draw is seeded by the seed and the position, as served)."""
    from coral_dagster.runtime.generate import generate as run
    from coral_dagster.runtime.sampling import SamplingParams

    sampling = None if greedy else SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    c = run(model, prompt, max_tokens, ignore_eos, sampling=sampling)
    data = {"text": c.text, "tokens": list(c.tokens), "finish_reason": c.finish_reason,
            "prompt_tokens": c.prompt_tokens}
    click.echo(json.dumps(data) if as_json else c.text)


def _main() -> None:
    try:
        serve(standalone_mode=True)
    except CoralError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    _main()
