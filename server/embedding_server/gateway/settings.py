"""The gateway's settings: every field is a flag of ``embedding-server gateway`` and an
``EMBEDDING_GATEWAY_*`` variable (the CLI and the reference page derive from these fields,
as the server's do from :mod:`embedding_server.settings`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

Priority = Literal["interactive", "bulk"]

GATEWAY_ENV_PREFIX = "EMBEDDING_GATEWAY_"

MAX_TIMEOUT_SECONDS = 3600.0
"""The most --hold-timeout and --request-timeout may be: an hour. Clients and load balancers
have given up long before; a larger value is most likely milliseconds given for seconds
(and an infinite one would make Retry-After unwritable)."""


class GatewaySettings(BaseSettings):
    """How the gateway listens, finds its models, picks endpoints and holds requests."""

    model_config = SettingsConfigDict(env_prefix=GATEWAY_ENV_PREFIX, extra="forbid")

    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8080, gt=0, lt=65536, description="Port to listen on.")
    discovery: Literal["static", "kubernetes"] = Field(
        "static",
        description="Where models and endpoints come from: static (--routes and/or "
        "--routes-file) or kubernetes (EmbeddingServices and their EndpointSlices, read with "
        "the pod's service account).",
    )
    routes: Annotated[list[str] | None, NoDecode] = Field(
        None,
        description="Static routes, comma-separated MODEL=URL items (a model repeated gets "
        "several endpoints): minilm=http://10.0.0.1:8000,minilm=http://10.0.0.2:8000.",
    )
    routes_file: str | None = Field(
        None,
        description="A YAML or JSON file of static routes: 'models: [{name, aliases: [...], "
        "endpoints: [URL, ...]}]'. Read again when it changes (checked every second).",
    )
    namespace: str | None = Field(
        None,
        description="With --discovery kubernetes: the namespace to watch. Unset: every "
        "namespace (needs cluster-wide RBAC).",
    )
    reserved_model_names: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="With --discovery kubernetes: model names only some namespaces may "
        "claim, comma-separated PATTERN=NAMESPACE[|NAMESPACE...] items (shell patterns, the "
        "first that matches a name decides), e.g. 'text-embedding-*=search|ml'. Any other "
        "name is owned by its oldest claimant; a claim that loses is not routed. The "
        "operator's --reserved-model-names must say the same (the chart sets both).",
    )
    models_listing: Literal["names", "full", "none"] = Field(
        "names",
        description="What GET /v1/models and the errors naming known models show a caller "
        "(the gateway authenticates nobody, so every caller alike): names (each model's "
        "names and aliases, leaving out EmbeddingServices whose pods need an API key), full "
        "(every model, with its ready endpoints: for a gateway only trusted clients reach) "
        "or none (an empty list; errors name no other model).",
    )
    poll_interval: float = Field(
        0.075,
        ge=0.01,
        le=5.0,
        description="Seconds between polls of each endpoint's GET /load (its queued and "
        "running tokens and backlog seconds).",
    )
    poll_timeout: float = Field(
        0.5, gt=0, le=10.0, description="Seconds a /load poll may take before it counts as failed."
    )
    poll_concurrency: int = Field(
        32, ge=1, description="Most /load polls in flight at once, over all endpoints."
    )
    balancing: Literal["least-backlog", "random"] = Field(
        "least-backlog",
        description="How an endpoint is picked: least-backlog (power of two choices on "
        "polled backlog plus the gateway's own in-flight tokens) or random (kube-proxy's "
        "choice; for comparison).",
    )
    request_timeout: float = Field(
        60.0,
        gt=0,
        le=MAX_TIMEOUT_SECONDS,
        description="Seconds a request's upstream work may take, one retry included, counted "
        "from when a ready endpoint is picked (time held before that counts against "
        "--hold-timeout, not this); past it the client gets 504. Receiving the request "
        "is bounded by --header-timeout and --body-timeout, sending the answer by "
        "--write-timeout.",
    )
    hold_timeout: float = Field(
        300.0,
        ge=0,
        le=MAX_TIMEOUT_SECONDS,
        description="Seconds in all a request for a model with no ready endpoint is held "
        "before it gets 503 with Retry-After (0: answer 503 at once). The "
        "default covers a cold start on a node without the image: the autoscaler's scrape "
        "and poll, the 6.4 GB server image's pull and the model's load. Once released, the "
        "request gets the whole --request-timeout.",
    )
    max_held_requests: int = Field(
        256, ge=0, description="Most requests held per model; past it, 503 with Retry-After."
    )
    max_held_tokens: int = Field(
        262144,
        ge=0,
        description="Most estimated tokens (body bytes / 4) held per model; past it, 503.",
    )
    max_request_bytes: int = Field(
        16 * 1024 * 1024, gt=0, description="Largest request body forwarded; larger gets 413."
    )
    max_buffered_bytes: int = Field(
        128 * 1024 * 1024,
        gt=0,
        description="Bytes of request bodies and upstream answers the gateway holds at once, "
        "all connections together (it holds each whole, to retry it on another endpoint): "
        "a body is charged by its Content-Length before it is read, an answer by its "
        "Content-Length before it is read, each until it is dropped. A request that does "
        "not fit gets 503 with Retry-After (server_busy) and its connection is closed. The "
        "first 64 KiB of each body and answer do not count, so small requests are never "
        "refused by it. A held byte can cost up to two while it is copied: keep this under "
        "a third of the gateway's memory limit. At least --max-request-bytes.",
    )
    max_header_bytes: int = Field(
        32768,
        gt=0,
        description="Largest request line and headers accepted: beyond it the connection is "
        "answered 431 and closed as the bytes arrive.",
    )
    header_timeout: float = Field(
        10.0,
        gt=0,
        le=MAX_TIMEOUT_SECONDS,
        description="Seconds a client has to send a request's line and headers, from "
        "connecting (or from the first byte of the next request on a kept-alive connection); "
        "then it gets 408 and the connection is closed. Ends connections that never send a "
        "request and headers sent a byte at a time.",
    )
    body_timeout: float = Field(
        30.0,
        gt=0,
        le=MAX_TIMEOUT_SECONDS,
        description="Seconds a client has to send a request's whole body once its headers "
        "have arrived; then it gets 408 (request_timeout) and the connection is closed.",
    )
    write_timeout: float = Field(
        30.0,
        gt=0,
        le=MAX_TIMEOUT_SECONDS,
        description="Seconds a client has to take a whole answer once the gateway starts "
        "sending it; then the connection is closed and the answer's bytes given back (a "
        "client that does not read). Answers are written as the client reads them, never "
        "copied whole into the socket's buffer.",
    )
    keep_alive_timeout: float = Field(
        5.0,
        gt=0,
        le=MAX_TIMEOUT_SECONDS,
        description="Seconds an idle kept-alive connection stays open.",
    )
    max_connections: int = Field(
        1024,
        gt=0,
        description="Most open client connections: a connection beyond it is answered 503 "
        "and closed at once.",
    )
    probe_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Also serve /health, /ready and /metrics on this port, on connections of "
        "their own: they do not count against --max-connections, so clients that hold every "
        "client connection cannot starve the kubelet's probes (past the probe port's own cap "
        "of 64, a connection that is not in a request is closed to make room: the oldest of "
        "the peer address that holds the most). "
        "Unset: the probes share the client port.",
    )
    max_connections_per_endpoint: int = Field(
        256, ge=1, description="Connections kept open to each endpoint at most."
    )
    saturation_backlog_seconds: float = Field(
        2.0,
        gt=0,
        description="An endpoint whose polled backlog reaches this many seconds is saturated; "
        "when every ready endpoint of a model is, bulk requests get 429.",
    )
    bulk_routes: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Routes whose requests are bulk unless X-Priority says otherwise "
        "(comma-separated paths, e.g. /v1/embeddings); other routes default to interactive.",
    )
    bulk_api_keys_file: str | None = Field(
        None,
        description="A file of API keys, one per line ('#' comments), whose requests are bulk "
        "whatever their X-Priority says: the key of an 'Authorization: Bearer' header is "
        "looked up before the header and --bulk-routes. Only the keys' SHA-256 digests are "
        "kept and none "
        "is ever logged; the file (a mounted Secret) is read again when it changes.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level."
    )
    log_format: Literal["json", "text"] = Field("text", description="Log format.")

    @field_validator("routes", "bulk_routes", "reserved_model_names", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        # NoDecode: the variables are comma-separated like the flags, not JSON lists.
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value

    @field_validator("reserved_model_names")
    @classmethod
    def _reservations(cls, value: list[str]) -> list[str]:
        from embedding_server.gateway.kubernetes import ReservedNames

        ReservedNames(value)  # a malformed item is a settings error, named, at start
        return value

    @model_validator(mode="after")
    def _static_routes_given(self) -> GatewaySettings:
        if self.discovery == "static" and not self.routes and not self.routes_file:
            raise ValueError("--discovery static needs --routes or --routes-file")
        if self.discovery == "kubernetes" and (self.routes or self.routes_file):
            raise ValueError("--routes and --routes-file apply to --discovery static only")
        if self.max_buffered_bytes < self.max_request_bytes:
            raise ValueError(
                "--max-buffered-bytes must be at least --max-request-bytes: a body of the "
                "largest size could never be held"
            )
        if self.probe_port is not None and self.probe_port == self.port:
            raise ValueError(f"--probe-port must differ from --port ({self.port})")
        return self
