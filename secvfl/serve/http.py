"""The label party's prediction endpoint: the Open Inference Protocol's REST shape over HTTPS with client certificates.

Routes (the REST form of the Open Inference Protocol, "v2", that KServe, Triton and MLServer speak)::

    GET  /v2/health/live                    200 while the process runs
    GET  /v2/health/ready                   200 once every party has loaded its model, else 503 with the reason
    GET  /v2                                server metadata
    GET  /v2/models/{name}[/versions/{v}]   model metadata: inputs, outputs, classes, parties
    GET  /v2/models/{name}/ready            as /v2/health/ready, for the model
    POST /v2/models/{name}[/versions/{v}]/infer
         {"inputs": [{"name": "entity_id", "datatype": "BYTES", "shape": [n], "data": ["c1", ...]}],
          "parameters": {"deadline_ms": 500}}                       (parameters and "id" optional)
      -> {"model_name", "model_version", "id", "parameters": {"classes": [...]},
          "outputs": [probabilities FP32 [n, C], predicted_class BYTES [n], contributors BYTES [n]
                      (the parties whose features were used, comma-separated), predictors BYTES [n] (LASER-VFL:
                      the parties whose predictors answered), error BYTES [n] ("" when the id was scored)]}

Every failure is one JSON object ``{"error": "<one line>"}`` with a 4xx for the client's mistakes: 400 malformed
JSON or a body that is not an inference request, an empty id list or ids that are not strings; 401 no client
certificate; 404 an unknown model name or ids no party holds; 413 more ids (or bytes) than allowed; 429 the queue of
waiting requests is full (with Retry-After). 503: the federation is not ready; 504: the request's deadline passed
in the queue. A failure never stops the server.

Why uvicorn and Starlette: uvicorn is the maintained, widely deployed ASGI server (KServe's Python model server runs
on it), it terminates TLS with the standard library's ``ssl`` (so client certificates are verified by OpenSSL
against the serving CA), and it runs on httptools' C parser and uvloop where installed (both are dependencies;
measured with `secvfl bench serve`: about 20 % less CPU per request in the label party's process than its pure-Python
parser on asyncio's loop, which remain the fallback); Starlette is the small routing layer under FastAPI without the
validation framework (request bodies are decoded by msgspec, which secvfl already uses for its wire format, with
typed, bounded decoding). Client certificates are requested (``CERT_OPTIONAL``) rather than required at the TLS
layer so that a client without one gets an HTTP 401 that says so, instead of a bare TLS alert; a certificate that
does not verify against the serving CA still fails the TLS handshake.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from secvfl import __version__
from secvfl.serve.audit import AuditLog
from secvfl.serve.batching import Batcher, DeadlineExceeded, QueueFull
from secvfl.serve.coordinator import Coordinator, Scored, ServeLimits
from secvfl.serve.wire import MAX_ID_CHARS

__all__ = ["make_app", "make_server", "INPUT_NAME"]

INPUT_NAME = "entity_id"
_OPEN = ("/v2/health/live", "/v2/health/ready")  # probes need no client certificate


class _Tensor(msgspec.Struct):
    name: str
    shape: list[int]
    datatype: str
    data: list[Any]
    parameters: dict[str, Any] | None = None


class _InferRequest(msgspec.Struct):
    inputs: list[_Tensor]
    id: str | None = None
    parameters: dict[str, Any] | None = None
    outputs: list[dict[str, Any]] | None = None


_DECODER = msgspec.json.Decoder(_InferRequest)
_ENCODER = msgspec.json.Encoder()


class _Refused(Exception):
    def __init__(self, status: int, reason: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(reason)
        self.status, self.reason, self.headers = status, reason, headers or {}


def _ids_of(body: bytes, limits: ServeLimits) -> tuple[list[str], str | None, float | None]:
    """The entity ids of an inference request, its id and its deadline; :class:`_Refused` with the reason."""
    try:
        request = _DECODER.decode(body)
    except msgspec.ValidationError as exc:
        raise _Refused(400, f"the body is not an Open Inference Protocol inference request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise _Refused(400, f"the body is not valid JSON: {exc}") from None
    if len(request.inputs) != 1 or request.inputs[0].name != INPUT_NAME:
        got = [t.name for t in request.inputs]
        raise _Refused(400, f"one input named {INPUT_NAME!r} (the entity ids, datatype BYTES) is expected, got {got}")
    tensor = request.inputs[0]
    if tensor.datatype != "BYTES":
        raise _Refused(400, f"input {INPUT_NAME!r} has datatype {tensor.datatype}; entity ids are strings: BYTES")
    ids = tensor.data
    n = len(ids)
    if n == 0:
        raise _Refused(400, "the request names no entity id; put at least one in inputs[0].data")
    if n > limits.max_ids_per_request:
        raise _Refused(413, f"{n} ids in one request, over the limit of {limits.max_ids_per_request} (--max-ids); "
                            "split the request")
    if tensor.shape not in ([n], [n, 1]):
        raise _Refused(400, f"input {INPUT_NAME!r} has shape {tensor.shape} but {n} ids; use shape [{n}]")
    bad = next((v for v in ids if not isinstance(v, str) or not 0 < len(v) <= MAX_ID_CHARS), None)
    if bad is not None or any(not isinstance(v, str) for v in ids):
        raise _Refused(400, f"entity id {bad!r:.80} is not a string of 1 to {MAX_ID_CHARS} characters")
    deadline = None
    params = request.parameters or {}
    unknown = sorted(set(params) - {"deadline_ms"})
    if unknown:
        raise _Refused(400, f"unknown request parameters {unknown}; this model takes deadline_ms")
    if "deadline_ms" in params:
        value = params["deadline_ms"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= limits.deadline_ms:
            raise _Refused(400, f"parameters.deadline_ms must be a number in (0, {limits.deadline_ms:g}] (the "
                                f"server's --deadline-ms), got {value!r:.40}")
        deadline = float(value) / 1000.0
    return ids, request.id, deadline


def _bytes_output(name: str, values: list[str]) -> dict[str, Any]:
    return {"name": name, "datatype": "BYTES", "shape": [len(values)], "data": values}


def make_app(coordinator: Coordinator, batcher: Batcher, *, model_name: str, limits: ServeLimits,
             audit: AuditLog, client_of: Callable[[Any], str | None], startup_error: Callable[[], str]) -> Any:
    """The Starlette application. ``client_of(scope)`` names the verified client certificate of a connection (None
    without one); ``startup_error()`` says why the federation is not ready ("" while it is starting)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    def refuse(status: int, reason: str, headers: dict[str, str] | None = None) -> Response:
        return Response(_ENCODER.encode({"error": reason}), status_code=status, media_type="application/json",
                        headers=headers)

    def not_ready() -> str:
        return startup_error() or "the federation is starting: waiting for every party to load its model"

    def check_model(request: Request) -> None:
        name = request.path_params["name"]
        if name != model_name:
            raise _Refused(404, f"no model named {name!r}; this server serves {model_name!r}")
        version = request.path_params.get("version")
        if version is not None and version != coordinator.model_version:
            raise _Refused(404, f"model {model_name!r} has no version {version!r}; it serves "
                                f"{coordinator.model_version!r}")

    async def live(request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(request: Request) -> Response:
        if coordinator.ready:
            return JSONResponse({"ready": True})
        return refuse(503, not_ready())

    async def server_metadata(request: Request) -> Response:
        return JSONResponse({"name": "secvfl", "version": __version__, "extensions": []})

    async def model_metadata(request: Request) -> Response:
        try:
            check_model(request)
        except _Refused as exc:
            return refuse(exc.status, exc.reason)
        facts = coordinator.describe()
        C = len(coordinator.classes)
        return JSONResponse({
            "name": model_name, "versions": [coordinator.model_version], "platform": f"secvfl-{facts['algorithm']}",
            "inputs": [{"name": INPUT_NAME, "datatype": "BYTES", "shape": [-1]}],
            "outputs": [{"name": "probabilities", "datatype": "FP32", "shape": [-1, C]},
                        {"name": "predicted_class", "datatype": "BYTES", "shape": [-1]},
                        {"name": "contributors", "datatype": "BYTES", "shape": [-1]},
                        {"name": "predictors", "datatype": "BYTES", "shape": [-1]},
                        {"name": "error", "datatype": "BYTES", "shape": [-1]}],
            "parameters": {**facts, "max_ids": limits.max_ids_per_request, "deadline_ms": limits.deadline_ms},
        })

    async def model_ready(request: Request) -> Response:
        try:
            check_model(request)
        except _Refused as exc:
            return refuse(exc.status, exc.reason)
        return await ready(request)

    async def stats(request: Request) -> Response:
        try:
            check_model(request)
        except _Refused as exc:
            return refuse(exc.status, exc.reason)
        return JSONResponse({"model_name": model_name, **batcher.stats.to_dict(), "queued": batcher.queued()})

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
            raise _Refused(413, f"the body has {declared} bytes, over the limit of {limits.max_body_bytes}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_body_bytes:
                raise _Refused(413, f"the body is over the limit of {limits.max_body_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def infer(request: Request) -> Response:
        client = client_of(request.scope) or "?"
        try:
            check_model(request)
            if not coordinator.ready:
                raise _Refused(503, not_ready())
            ids, request_id, deadline_s = _ids_of(await read_body(request), limits)
            deadline_s = deadline_s if deadline_s is not None else limits.deadline_ms / 1000.0
            try:
                future = batcher.submit(ids, time.monotonic() + deadline_s)
            except QueueFull as exc:
                raise _Refused(429, str(exc), {"Retry-After": "1"}) from None
            try:
                scored, rows = await asyncio.wrap_future(future)
            except DeadlineExceeded as exc:
                raise _Refused(504, str(exc)) from None
            except QueueFull as exc:
                raise _Refused(503, str(exc)) from None
        except _Refused as exc:
            audit.write(client=client, status=exc.status, reason=exc.reason)
            return refuse(exc.status, exc.reason, exc.headers)
        return respond(scored, rows, ids, request_id, client)

    def respond(scored: Scored, rows: list[int], ids: list[str], request_id: str | None, client: str) -> Response:
        unknown = [ids[j] for j, i in enumerate(rows) if i in scored.unknown]
        if unknown:
            shown = ", ".join(repr(u) for u in unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5
                                                                 else "")
            reason = f"unknown entity id{'s' if len(unknown) > 1 else ''} {shown}: no party holds them"
            audit.write(client=client, status=404, ids=ids, reason=reason)
            return refuse(404, reason)
        proba = scored.probabilities[rows]
        errors = [scored.errors[i] for i in rows]
        classes = coordinator.classes
        predicted = [classes[int(k)] if not e else "" for k, e in zip(np.argmax(proba, axis=1), errors, strict=True)]
        audit.write(client=client, status=200, ids=ids, scored=sum(1 for e in errors if not e))
        body = {
            "model_name": model_name, "model_version": coordinator.model_version,
            **({"id": request_id} if request_id is not None else {}),
            "parameters": {"classes": list(classes)},
            "outputs": [
                {"name": "probabilities", "datatype": "FP32", "shape": list(proba.shape),
                 "data": proba.reshape(-1).tolist()},
                _bytes_output("predicted_class", predicted),
                _bytes_output("contributors", [",".join(scored.contributors[i]) for i in rows]),
                _bytes_output("predictors", [",".join(scored.predictors[i]) for i in rows]),
                _bytes_output("error", errors),
            ],
        }
        return Response(_ENCODER.encode(body), media_type="application/json")

    async def gate(scope: Any, receive: Any, send: Any) -> None:
        """Every route but the health probes needs a verified client certificate."""
        if scope["type"] == "http" and scope["path"] not in _OPEN and client_of(scope) is None:
            reason = ("this endpoint needs a client certificate issued by the serving CA (e.g. curl --cert "
                      "client.pem --key client.key); none was presented")
            await refuse(401, reason)(scope, receive, send)
            return
        await app(scope, receive, send)

    routes = [
        Route("/v2/health/live", live), Route("/v2/health/ready", ready), Route("/v2", server_metadata),
        Route("/v2/models/{name}", model_metadata), Route("/v2/models/{name}/versions/{version}", model_metadata),
        Route("/v2/models/{name}/ready", model_ready), Route("/v2/models/{name}/stats", stats),
        Route("/v2/models/{name}/infer", infer, methods=["POST"]),
        Route("/v2/models/{name}/versions/{version}/infer", infer, methods=["POST"]),
    ]
    app = Starlette(routes=routes)
    return gate


def _common_name(cert: dict[str, Any] | None) -> str | None:
    if not cert:
        return None
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return "(no common name)"


def make_server(app_factory: Callable[[Callable[[Any], str | None]], Any], *, host: str, port: int, cert: Path,
                key: Path, client_ca: Path, limits: ServeLimits) -> Any:
    """A uvicorn server for ``app_factory(client_of)`` on host:port with TLS (``cert``/``key``), asking every client
    for a certificate that verifies against ``client_ca``."""
    import uvicorn

    try:  # uvicorn's C-accelerated HTTP/1.1 parser (httptools) where installed, else its pure-Python one (h11)
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Protocol
    except ImportError:  # pragma: no cover - httptools is a dependency; kept working without it
        from uvicorn.protocols.http.h11_impl import H11Protocol as Protocol  # type: ignore[assignment]
    try:
        import uvloop  # noqa: F401 - the faster event loop where installed
        loop = "uvloop"
    except ImportError:  # pragma: no cover
        loop = "asyncio"

    clients: dict[tuple[str, int], str | None] = {}

    class ClientCertProtocol(Protocol):  # type: ignore[valid-type,misc]
        """uvicorn's HTTP/1.1 protocol, remembering each connection's verified client certificate (uvicorn does not
        pass the ASGI TLS extension on to the application)."""

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            peer = transport.get_extra_info("peername")
            if peer:
                clients[(peer[0], peer[1])] = _common_name(transport.get_extra_info("peercert"))

        def connection_lost(self, exc: Exception | None) -> None:
            peer = self.transport.get_extra_info("peername") if self.transport is not None else None
            if peer:
                clients.pop((peer[0], peer[1]), None)
            super().connection_lost(exc)

    def client_of(scope: Any) -> str | None:
        peer = scope.get("client")
        return clients.get((peer[0], peer[1])) if peer else None

    config = uvicorn.Config(app_factory(client_of), host=host, port=port, ssl_certfile=str(cert),
                            ssl_keyfile=str(key), ssl_ca_certs=str(client_ca), ssl_cert_reqs=ssl.CERT_OPTIONAL,
                            http=ClientCertProtocol, loop=loop, log_level="warning", access_log=False, lifespan="off",
                            limit_concurrency=limits.max_queued_requests + 64, timeout_keep_alive=30)
    return uvicorn.Server(config)
