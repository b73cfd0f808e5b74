"""``embedding-operator``: ``run`` the operator, or ``render`` the children of a manifest.

``run`` flags are derived from ``OperatorSettings`` (``settings.add_settings_flags``: one flag
per field, its description as the help); anything not given on the command line comes from
``EMBEDDING_OPERATOR_*`` variables, then defaults. kopf runs in-process (``kopf.operator``) in
standalone mode, next to the work queue's ``Controller``, under Lease-based leader election when
``--leader-elect`` is set (see ``leader.py`` for why not kopf peering).

``render -f es.yaml`` prints what the operator would create, from the same pure builders, with
no cluster: for review, for diffs in CI, and to see the effect of a spec change. A spec the
operator would refuse (Degraded, nothing applied) is refused here too, with the same message.
An EmbeddingJob renders as its ServiceAccount, planner Job and worker Job (with
``--job-shards`` shards: render reads no store), from its EmbeddingService in the same file
when there is one.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from embedding_operator.builders.common import (
    DEFAULT_GATEWAY_NAMESPACE,
    DEFAULT_IMAGE,
    KIND,
    AutoscalingDefaults,
    Owner,
)
from embedding_operator.jobs.builders import (
    JOB_KIND,
    ServiceTarget,
    build_planner_job,
    build_service_account,
    build_worker_job,
)
from embedding_operator.jobs.spec import parse_job_spec
from embedding_operator.plan import Refused, plan
from embedding_operator.policy import WorkloadPolicy
from embedding_operator.profiles import GpuProfiles, ProfileConfigError
from embedding_operator.settings import (
    OperatorSettings,
    add_settings_flags,
    own_namespace,
    settings_from_args,
)
from embedding_operator.spec import InvalidSpecError, parse_spec

log = logging.getLogger("embedding_operator")

EXIT_USAGE = 2
EXIT_LEADERSHIP_LOST = 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="embedding-operator", description="Kubernetes operator for EmbeddingService."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        help="Run the operator against the current cluster.",
        description="Flags may also be set as EMBEDDING_OPERATOR_<FLAG> environment variables.",
    )
    add_settings_flags(run)
    render = sub.add_parser("render", help="Print the child manifests of EmbeddingServices.")
    render.add_argument(
        "-f",
        "--filename",
        required=True,
        type=Path,
        help="EmbeddingService manifest(s) ('-' for stdin).",
    )
    render.add_argument(
        "--namespace", default="default", help="Namespace for manifests that name none."
    )
    render.add_argument(
        "--gpu-profiles", type=Path, default=None, help="GPU profiles file, as for run."
    )
    render.add_argument("--default-image", default=None, help="Image, as for run.")
    render.add_argument(
        "--allowed-images", default="", help="Image allowlist, as for run (comma-separated)."
    )
    render.add_argument(
        "--allowed-priority-classes",
        default="",
        help="Priority-class allowlist, as for run (comma-separated).",
    )
    for flag, what in (
        ("--allowed-env", "Extra env-name patterns"),
        ("--allowed-extended-resources", "Extended-resource patterns"),
        ("--allowed-service-types", "Service types"),
        ("--allowed-service-annotations", "Service annotation-key patterns"),
    ):
        render.add_argument(flag, default="", help=f"{what}, as for run (comma-separated).")
    render.add_argument(
        "--allow-control-plane",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Placement on control-plane nodes, as for run.",
    )
    render.add_argument(
        "--default-autoscaler",
        choices=["hpa", "keda"],
        default="hpa",
        help="The autoscaler of specs that name none, as for run.",
    )
    render.add_argument(
        "--keda-prometheus-address", default="", help="KEDA's Prometheus, as for run."
    )
    render.add_argument(
        "--keda-gateway-namespace",
        default=DEFAULT_GATEWAY_NAMESPACE,
        help="The gateway's namespace, as for run (default: the chart's documented one, "
        f"{DEFAULT_GATEWAY_NAMESPACE}).",
    )
    render.add_argument(
        "--operator-namespace",
        default=DEFAULT_GATEWAY_NAMESPACE,
        help="The operator's namespace, which a NetworkPolicy admits to the pods' probe port "
        f"(default: the chart's documented one, {DEFAULT_GATEWAY_NAMESPACE}).",
    )
    render.add_argument(
        "--keda-gateway-job", default="", help="Prometheus's job for the gateway, as for run."
    )
    render.add_argument(
        "--job-shards",
        type=int,
        default=1,
        help="For an EmbeddingJob: the shards its planner would report (the worker Job's "
        "completions), since render reads no store.",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "render":
        return render_command(args)
    try:
        config = settings_from_args(args)
        profiles = GpuProfiles.load(config.gpu_profiles)
    except (ValidationError, ProfileConfigError) as exc:
        sys.stderr.write(f"embedding-operator: invalid configuration: {exc}\n")
        return EXIT_USAGE
    return run_command(config, profiles)


# --- render -----------------------------------------------------------------------------------


def _names(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


def render_command(args: argparse.Namespace) -> int:
    text = (
        sys.stdin.read() if str(args.filename) == "-" else args.filename.read_text(encoding="utf-8")
    )
    try:
        profiles = GpuProfiles.load(args.gpu_profiles)
    except ProfileConfigError as exc:
        sys.stderr.write(f"embedding-operator: {exc}\n")
        return EXIT_USAGE
    policy = WorkloadPolicy(
        allowed_images=_names(args.allowed_images),
        allowed_priority_classes=_names(args.allowed_priority_classes),
        allowed_env=_names(args.allowed_env),
        allow_control_plane=args.allow_control_plane,
        allowed_extended_resources=_names(args.allowed_extended_resources),
        allowed_service_types=_names(args.allowed_service_types),
        allowed_service_annotations=_names(args.allowed_service_annotations),
    )
    out: list[dict[str, Any]] = []
    docs = [doc for doc in yaml.safe_load_all(text) if isinstance(doc, dict)]
    for doc in docs:
        if doc.get("kind") == JOB_KIND:
            rendered = _render_job(doc, docs, args)
            if rendered is None:
                return EXIT_USAGE
            out += rendered
            continue
        if doc.get("kind") != KIND:
            continue
        meta = doc.get("metadata") or {}
        name = meta.get("name", "<unnamed>")
        owner = Owner(
            name=name,
            namespace=meta.get("namespace") or args.namespace,
            uid=meta.get("uid", ""),
            generation=1,
        )
        planned = plan(
            owner,
            doc.get("spec") or {},
            profiles,
            args.default_image or DEFAULT_IMAGE,
            policy,
            AutoscalingDefaults(
                args.default_autoscaler,
                args.keda_prometheus_address,
                args.keda_gateway_namespace,
                args.keda_gateway_job,
            ),
            meta.get("annotations"),
            args.operator_namespace,
        )
        if isinstance(planned, Refused):
            sys.stderr.write(f"embedding-operator: {name}: {planned.problem.message}\n")
            return EXIT_USAGE
        for manifest in planned.children.present:
            if not owner.uid:  # standalone output: no owner to point at
                manifest["metadata"].pop("ownerReferences", None)
            out.append(manifest)
    sys.stdout.write(yaml.safe_dump_all(out, sort_keys=False))
    return 0


def _render_job(
    doc: dict[str, Any], docs: list[dict[str, Any]], args: argparse.Namespace
) -> list[dict[str, Any]] | None:
    """An EmbeddingJob's ServiceAccount, planner Job and worker Job (``--job-shards``
    completions); the image and URL from its EmbeddingService when the file holds it, else
    the default image and the service's default port (``spec.model``: the default image, no
    service). None (and a message) if refused."""
    meta = doc.get("metadata") or {}
    name = meta.get("name", "<unnamed>")
    namespace = meta.get("namespace") or args.namespace
    image = args.default_image or DEFAULT_IMAGE
    try:
        spec = parse_job_spec(doc.get("spec") or {})
        service = None
        if spec.service is not None:
            service_doc = next(
                (
                    d
                    for d in docs
                    if d.get("kind") == KIND
                    and (d.get("metadata") or {}).get("name") == spec.service
                ),
                {},
            )
            service = parse_spec(service_doc.get("spec") or {"model": {"name": spec.service}})
    except InvalidSpecError as exc:
        sys.stderr.write(f"embedding-operator: {name}: {exc}\n")
        return None
    owner = Owner(name=name, namespace=namespace, uid=meta.get("uid", ""), generation=1)
    target = (
        ServiceTarget.own_pods(image)
        if spec.service is None or service is None
        else ServiceTarget.of(namespace, spec.service, service, image)
    )
    manifests = [
        build_service_account(owner),
        build_planner_job(owner, spec, target.image, target.pull_policy),
        build_worker_job(
            owner,
            spec,
            shards=max(1, args.job_shards),
            rows=0,
            image=target.image,
            service_url=target.url,
            model=target.model,
            pull_policy=target.pull_policy,
        ),
    ]
    if not owner.uid:
        for manifest in manifests:
            manifest["metadata"].pop("ownerReferences", None)
    return manifests


# --- run --------------------------------------------------------------------------------------


def _configure_logging(config: OperatorSettings) -> None:
    import kopf

    kopf.configure(
        debug=config.log_level == "debug",
        quiet=config.log_level == "warning",
        log_format=kopf.LogFormat.JSON if config.log_format == "json" else kopf.LogFormat.FULL,
    )
    # The kubernetes client logs every request at DEBUG and retries at WARNING; keep it quiet.
    logging.getLogger("urllib3").setLevel(logging.WARNING)


def run_command(config: OperatorSettings, profiles: GpuProfiles) -> int:
    import kopf

    from embedding_operator import handlers
    from embedding_operator.events import ApiEventRecorder
    from embedding_operator.jobs.handlers import job_workers, register_jobs
    from embedding_operator.jobs.pods import WatchedJobPods
    from embedding_operator.jobs.reconcile import JobReconciler
    from embedding_operator.kube import KubeCluster, api_client
    from embedding_operator.leader import (
        LeaderElector,
        LeadershipLostError,
        LeaseConfig,
    )
    from embedding_operator.metrics import OperatorMetrics, serve
    from embedding_operator.names import NameClaims, ReservedNames
    from embedding_operator.reconcile import Reconciler
    from embedding_operator.versions import WatchedPods, WatchedVersions

    _configure_logging(config)
    identity = config.resolved_identity()
    metrics = OperatorMetrics()
    # A connection per reconcile thread (EmbeddingServices' and EmbeddingJobs'), plus a few
    # for events and leader election.
    pool = config.workers + job_workers(config) + 4
    cluster = KubeCluster(api_client(pool), observe=metrics.requested)
    metrics_server = serve(metrics, config.metrics_port) if config.metrics_port else None
    versions = WatchedVersions()
    pods = WatchedPods()
    names = NameClaims(ReservedNames(config.reserved_model_names))
    reconciler = Reconciler(
        cluster=cluster,
        profiles=profiles,
        default_image=config.default_image,
        recorder=ApiEventRecorder(cluster, identity),
        policy=config.policy,
        versions=versions,
        full_resync_seconds=config.full_resync_seconds,
        autoscaling=config.autoscaling,
        metrics=metrics,
        pods=pods,
        names=names,
        operator_namespace=own_namespace(),
    )
    registry = kopf.OperatorRegistry()
    controller = handlers.register(registry, reconciler, config, versions, metrics, pods, names)
    job_pods = WatchedJobPods()
    job_controller = register_jobs(
        registry,
        JobReconciler(
            cluster=cluster,
            recorder=ApiEventRecorder(cluster, identity),
            default_image=config.default_image,
            pods=job_pods,
        ),
        config,
        job_pods,
        metrics,
    )
    settings = handlers.kopf_settings(config)
    log.info(
        "starting: namespaces=%s gpu-profiles=%s leader-elect=%s default-autoscaler=%s "
        "metrics-port=%s",
        ",".join(config.namespaces) or "<all>",
        ",".join(profiles.names()),
        config.leader_elect,
        config.default_autoscaler,
        config.metrics_port or "off",
    )

    async def work(stop_flag: asyncio.Event) -> None:
        metrics.leader.set(1)
        queue_task = asyncio.create_task(_run_all(stop_flag, controller, job_controller))
        # If the controller dies, stop kopf too; awaiting the task below re-raises its error.
        queue_task.add_done_callback(lambda _: stop_flag.set())
        try:
            await kopf.operator(
                registry=registry,
                settings=settings,
                standalone=True,
                clusterwide=config.clusterwide,
                namespaces=config.namespaces,
                liveness_endpoint=config.liveness,
                stop_flag=stop_flag,
            )
        finally:
            stop_flag.set()
            # kopf cancels the loop's tasks on shutdown; a cancelled queue is a clean stop,
            # a failed one re-raises here.
            await asyncio.wait([queue_task])
            if not queue_task.cancelled():
                queue_task.result()

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if not config.leader_elect:
            await work(stop)
            return
        elector = LeaderElector(
            cluster,
            LeaseConfig(
                name=config.lease_name,
                namespace=config.resolved_lease_namespace(),
                identity=identity,
                lease_duration=config.lease_duration_seconds,
                renew_deadline=config.renew_deadline_seconds,
                retry_period=config.retry_period_seconds,
            ),
        )
        from embedding_operator.leader import acquire, run_as_leader

        # While standing by, answer the liveness probe ourselves (kopf is not running yet).
        standby = await _standby_liveness(config.liveness) if config.liveness else None
        try:
            leading = await acquire(elector, stop)
        finally:
            if standby is not None:
                await standby.cleanup()
        if leading:
            await run_as_leader(elector, stop, work)

    try:
        asyncio.run(run())
    except LeadershipLostError as exc:
        log.error("%s; exiting so that a fresh process stands for election", exc)
        return EXIT_LEADERSHIP_LOST
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
    return 0


async def _run_all(stop: asyncio.Event, *controllers: Any) -> None:
    """Run every controller until ``stop``; the first to fail ends them all with its error."""
    tasks = [asyncio.create_task(c.run(stop)) for c in controllers]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)


async def _standby_liveness(url: str) -> Any:
    from aiohttp import web

    parsed = urllib.parse.urlsplit(url)

    async def alive(_: web.Request) -> web.Response:
        return web.json_response({"leader": False})

    app = web.Application()
    app.router.add_get(parsed.path or "/", alive)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, parsed.hostname or "0.0.0.0", parsed.port or 8080).start()
    return runner


if __name__ == "__main__":
    raise SystemExit(main())
