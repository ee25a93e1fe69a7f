"""Serving a trained federation (`secvfl serve`): each party's process, the label party's HTTPS endpoint.

Fast tests cover the pieces in this process: the fitted preprocessing against the training run's own preparation,
the serving messages' checks, the audit log's chain, the batcher's bounds, the request parser, client certificates.
The slow ones train federations with `secvfl launch` (one process per party), serve them with `secvfl serve` (one
process per party, the label party on HTTPS with client certificates, all on 127.0.0.1) and check the answers
against `secvfl predict` on the same model in one process (the reference: the parties' saved states assembled into
an in-process run over the joined table, scored by the in-process algorithms). Every process started here is
stopped by its process id; every wait is bounded.
"""

from __future__ import annotations

import csv
import hashlib
import http.client
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from secvfl.errors import ConfigError, MessageError
from secvfl.messages import Message, decode, encode
from secvfl.serve.local import LocalServing

# -- helpers: a federation of files, its training, its serving processes, the in-process reference ----------------


def _secvfl(*args: str) -> list[str]:
    return [sys.executable, "-m", "secvfl.cli.main", *args]


def _launch(fed: Path, out: Path, *args: str, timeout: float = 400) -> None:
    done = subprocess.run(_secvfl("launch", "--federation", str(fed), "--out", str(out), "--threads", "1", "--device", "cpu",
                                  "--party-timeout", "120", "--heartbeat", "0.5", "--no-progress", *args),
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]


def _free_port() -> int:
    from secvfl.deploy.loopback import free_loopback_ports

    return free_loopback_ports(1)[0]


def _client_context(demo: Path, *, with_cert: bool = True) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(demo / "certs" / "ca.pem"))
    if with_cert:
        ctx.load_cert_chain(str(demo / "certs" / "clients" / "app.pem"), str(demo / "certs" / "clients" / "app.key"))
    return ctx


class Served(LocalServing):
    """The serving processes of one trained run (secvfl.serve.local), with the requests the tests make."""

    def __init__(self, demo: Path, run: Path, *extra: str, tables: dict[str, Path] | None = None) -> None:
        super().__init__(demo, run, port=_free_port(), extra=extra, tables=tables,
                         party_flags=["--party-timeout", "120", "--peer-timeout", "5", "--heartbeat", "0.5"])
        try:
            self.wait_ready(timeout=240)
        except ConfigError:
            self.close()
            raise

    def post(self, path: str, body: bytes, conn: http.client.HTTPSConnection | None = None) -> tuple[int, dict]:
        own = conn is None
        conn = conn or self.connection()
        try:
            conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, json.loads(r.read())
        finally:
            if own:
                conn.close()

    def infer(self, ids: list[str], conn: http.client.HTTPSConnection | None = None, **params: object
              ) -> tuple[int, dict]:
        body = {"inputs": [{"name": "entity_id", "datatype": "BYTES", "shape": [len(ids)], "data": ids}]}
        if params:
            body["parameters"] = params
        return self.post("/v2/models/demo/infer", json.dumps(body).encode(), conn)

    def close(self) -> None:
        self.stop()


def outputs(body: dict) -> dict[str, object]:
    out = {o["name"]: o for o in body["outputs"]}
    n = out["error"]["shape"][0]
    proba = np.asarray(out["probabilities"]["data"], dtype=np.float64).reshape(n, -1)
    return {"proba": proba, **{k: out[k]["data"] for k in ("predicted_class", "contributors", "predictors", "error")}}


def _read_csv(path: Path) -> tuple[list[str], list[list[str]]]:
    with path.open(newline="") as fh:
        rows = list(csv.reader(fh))
    return rows[0], rows[1:]


def reference(demo: Path, run: Path, tmp: Path, observed: list[int] | None = None) -> dict[str, np.ndarray]:
    """`secvfl predict` on the test split of the same model in one process: entity id -> class probabilities.

    The in-process run: the rows every party holds, in the label party's file order, joined into one CSV (feature
    columns in party order, then the label) -- what the launched run trained on (tests/test_deploy_data.py) -- and a
    checkpoint holding the label party's and every feature party's saved state (each party's own file, as the
    label party's checkpoint names it)."""
    from secvfl.checkpoint import _checksum
    from secvfl.cli.main import main
    from secvfl.data.csv_loader import encode_labels
    from secvfl.data.preprocess import split_rows
    from secvfl.deploy.remote import load_party_state
    from secvfl.federation import load_federation
    from secvfl.io import torch_bytes, torch_load
    from secvfl.runner import read_run_config

    federation = load_federation(demo / "federation.toml")
    _, label_rows = _read_csv(demo / "label.csv")
    features = []
    for p in federation.feature_parties:
        header, rows = _read_csv(p.data.file)
        features.append((header[1:], {r[0]: r[1:] for r in rows}))
    joined = [r for r in label_rows if all(r[0] in table for _, table in features)]
    tmp.mkdir(parents=True, exist_ok=True)
    with (tmp / "joined.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow([c for names, _ in features for c in names] + ["label"])
        for r in joined:
            w.writerow([v for _, table in features for v in table[r[0]]] + [r[1]])
    cfg = read_run_config(run / "label")
    y, _ = encode_labels([r[1] for r in joined], "label")
    test_ids = [joined[i][0] for i in split_rows(y, seed=cfg.seed, val_fraction=cfg.val_fraction)[2]]
    inproc = tmp / "inproc"
    shutil.copytree(run / "label", inproc, ignore=shutil.ignore_patterns("audit", "*.log"))
    config = (inproc / "config.toml").read_text()
    (inproc / "config.toml").write_text(config.replace(f'dataset = "{cfg.dataset}"',
                                                       f'dataset = "csv:{tmp / "joined.csv"}"'))
    latest = json.loads((inproc / "checkpoints" / "latest.json").read_text())
    target = inproc / "checkpoints" / latest["dir"]
    meta = json.loads((target / "run.json").read_text())
    meta.pop("checksum")
    for name in [p.name for p in federation.feature_parties]:
        record = torch_load(target / f"party-{name}.pt")
        data = torch_bytes(load_party_state(run / name, name, record)["party"])
        (target / f"party-{name}.pt").write_bytes(data)
        meta["files"][f"party-{name}.pt"] = hashlib.sha256(data).hexdigest()
    (target / "run.json").write_text(json.dumps({**meta, "checksum": _checksum(meta)}))
    args = ["predict", "--run", str(inproc), "--split", "test", "--out", str(tmp / "predicted.csv")]
    if observed is not None:
        args += ["--observed", ",".join(map(str, observed))]
    assert main(args) == 0
    header, rows = _read_csv(tmp / "predicted.csv")
    columns = [j for j, h in enumerate(header) if h.startswith("p_")]
    assert len(rows) == len(test_ids)
    return {ident: np.array([float(r[j]) for j in columns]) for ident, r in zip(test_ids, rows, strict=True)}


# -- fast: the pieces, in this process ----------------------------------------------------------------------------
def _wine_federation(tmp: Path) -> tuple[Path, dict]:
    from test_deploy_data import _files

    from secvfl.deploy.loopback import loopback_federation

    made = _files(tmp)
    return loopback_federation(tmp, 2, data=made["tables"]), made


def _as_parquet(csv_path: Path, out: Path, extra_lines: tuple[str, ...] = ()) -> Path:
    """The table (and ``extra_lines`` of CSV) as Parquet, as a data warehouse exports it: numbers typed (empty cells
    null), text as text."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    text = csv_path.read_bytes() + "".join(f"{line}\n" for line in extra_lines).encode()
    pq.write_table(pacsv.read_csv(pa.BufferReader(text), convert_options=pacsv.ConvertOptions(
        strings_can_be_null=False)), out)
    return out


@pytest.mark.parametrize(("seed", "large", "parquet"), [(0, False, False), (3, False, True), (3, True, False)],
                         ids=["csv", "parquet", "csv-float32"])
def test_served_rows_are_the_training_rows_bit_for_bit(tmp_path: Path, seed: int, large: bool, parquet: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A feature party's serving table, prepared with the preprocessing its training run saved, holds for every
    training, validation and test id exactly the row training prepared (missing cells filled, categories one-hot);
    from its CSV file, from the same table exported as Parquet, and read as a large table is (float32 minus a
    shift, prepared in row chunks). The reference: the rows the training code (prepare_own_block) returned."""
    import pyarrow.compute as pc

    from secvfl.config import TrainConfig
    from secvfl.deploy.data import plan_rows, prepare_own_block, read_own_file, save_preprocessing
    from secvfl.federation import load_federation
    from secvfl.serve.party import load_served_table

    if large:
        import secvfl.data.csv_loader as csv_loader
        import secvfl.data.preprocess as preprocess
        import secvfl.data.table as table_module

        monkeypatch.setattr(table_module, "EXACT_CELLS", 50)
        monkeypatch.setattr(csv_loader, "EXACT_CELLS", 50)
        monkeypatch.setattr(preprocess, "_CHUNK_ROWS", 13)
    fed = load_federation(_wine_federation(tmp_path)[0])
    cfg = TrainConfig(seed=seed)
    label = read_own_file(fed.party("label").data, "label")
    for name in ("party0", "party1"):
        own = read_own_file(fed.party(name).data, name)
        plan = plan_rows(label, {name: np.flatnonzero(pc.is_in(label.ids, value_set=own.ids).to_numpy(
            zero_copy_only=False))}, cfg)
        learned = np.flatnonzero(pc.is_in(own.ids, value_set=label.ids).to_numpy(zero_copy_only=False))
        expected, names, _, preprocessing = prepare_own_block(own, plan.ids, learned, cfg)
        save_preprocessing(tmp_path / name, preprocessing)
        file = _as_parquet(own.file, tmp_path / f"{name}.parquet") if parquet else None
        _, table = load_served_table(fed, name, tmp_path / name, file, log=lambda _: None)
        assert table.usable.all() and table.X.shape[1] == len(names)
        for split_ids, arr in zip(plan.ids, expected, strict=True):
            rows = table.rows(split_ids)
            assert (rows >= 0).all() and table.X.dtype == np.float32
            np.testing.assert_array_equal(table.X[rows], arr)


def test_new_rows_unseen_categories_missing_and_bad_cells(tmp_path: Path) -> None:
    """The rules for cells training never saw, on a preprocessing written out by hand (a number a, categories x and y
    of c; training means 1, .5, .5, deviations 2, .5, .5): values computed by hand."""
    from dataclasses import replace

    from secvfl.data.csv_loader import ColumnEncoding
    from secvfl.data.preprocess import Standardisation
    from secvfl.deploy.data import (
        Preprocessing,
        load_preprocessing,
        read_prepared_table,
        save_preprocessing,
    )
    from secvfl.errors import DataError
    from secvfl.federation import DataSpec

    fitted = Preprocessing("p", "train.csv", [ColumnEncoding("a", "number"), ColumnEncoding("c", "categories",
                                                                                            ["x", "y"])],
                           Standardisation(["a", "c=x", "c=y"], np.array([1.0, 0.5, 0.5]), np.array([2.0, 0.5, 0.5])))
    save_preprocessing(tmp_path, fitted)
    loaded = load_preprocessing(tmp_path)
    assert loaded.to_dict() == fitted.to_dict() and loaded.width == 3 and loaded.nan_policy == "mean"
    spec = DataSpec(file=tmp_path / "t.csv", id="id", columns=("a", "c"))

    def prepared(text: str, preprocessing: Preprocessing = fitted, name: str = "t.csv"):  # noqa: ANN202
        (tmp_path / name).write_text(text)
        return read_prepared_table(replace(spec, file=tmp_path / name), "p", preprocessing)

    table = prepared("id,a,c\nr1,3,x\nr2,,y\nr3,1,z\nr4,5,NA\n")
    # r1: (3-1)/2, one-hot x; r2: a missing -> its training mean -> 0; r3: category z unseen -> a missing cell ->
    # the training frequencies -> 0 (all zeros would give -1, -1); r4: c missing -> 0, 0
    np.testing.assert_array_equal(table.X, [[1, 1, -1], [0, -1, 1], [0, 0, 0], [2, 0, 0]])
    assert table.usable.all() and table.ids.to_pylist() == ["r1", "r2", "r3", "r4"]
    assert any("column 'c': 1 cell(s) hold a category training never saw" in n for n in table.notes)
    assert table.rows(["r3", "nobody", "r1"]).tolist() == [2, -1, 0]
    strict = replace(fitted, standardisation=replace(fitted.standardisation, nan_policy="error"))
    table = prepared("id,a,c\nr1,3,x\nr2,,y\nr3,1,z\n", strict)
    assert table.usable.tolist() == [True, False, False] and "--nan-policy error" in table.why_unusable
    np.testing.assert_array_equal(table.X[1:], 0.0)  # an unusable row is zeros, never NaN
    np.testing.assert_array_equal(table.X[0], [1, 1, -1])
    table = prepared("id,a,c\nr1,1,1\nr2,2,2\n")  # a column of categories read as text, though it holds numbers
    np.testing.assert_array_equal(table.X, [[0, 0, 0], [0.5, 0, 0]])
    with pytest.raises(DataError, match="t.csv line 3: column 'a' holds 'abc', not a number"):
        prepared("id,a,c\nr1,3,x\nr2,abc,y\n")
    with pytest.raises(DataError, match="t.csv line 2: column 'a' holds 'inf', an infinite number"):
        prepared("id,a,c\nr1,inf,x\nr2,1,y\n")
    with pytest.raises(DataError, match="no column 'c'"):
        prepared("id,a\nr1,3\n")
    (tmp_path / "t.csv").write_text("id,a,c\nr1,3,x\nr2,,y\nr3,1,z\n")
    parquet = _as_parquet(tmp_path / "t.csv", tmp_path / "t.parquet")
    np.testing.assert_array_equal(read_prepared_table(replace(spec, file=parquet), "p", fitted).X,
                                  [[1, 1, -1], [0, -1, 1], [0, 0, 0]])
    for damage, reason in (({"version": 1}, "format version 1"), ({"columns": "a"}, "is damaged"),
                           ({"standardisation": {**fitted.standardisation.to_dict(), "std": [1, 0, 1]}},
                            "do not fit together")):
        (tmp_path / "preprocessing.json").write_text(json.dumps({**fitted.to_dict(), **damage}))
        with pytest.raises(ConfigError, match=reason):
            load_preprocessing(tmp_path)


def test_serving_messages_are_checked_field_by_field() -> None:
    from secvfl.serve.wire import (
        Answer,
        Call,
        Group,
        answer_message,
        call_message,
        check_output,
        read_answer,
        read_call,
    )

    call = Call("predict", 7, step=7, groups=[Group(0, [0, 2], [1, 4])], budget_ms=250.0)
    assert read_call(decode(encode(call_message("label", "party0", call))), "label", "party0") == call
    answer = Answer("embed", 7, missing=[3])
    assert read_answer(decode(encode(answer_message("party0", "label", answer))), "party0", "label") == answer
    forged = Message("serve-call", "party1", "party0", 7, meta={"op": "embed", "request": 7})
    with pytest.raises(MessageError, match="expected a serve-call message from label"):
        read_call(decode(encode(forged)), "label", "party0")
    for meta, why in (({"op": "drop", "request": 7}, "op"), ({"op": "embed", "request": 7, "ids": [5]}, "ids"),
                      ({"op": "embed", "request": 7, "extra": 1}, "extra"), ({"op": "embed", "request": 6}, "request"),
                      ({"op": "embed", "request": 7, "ids": ["x" * 300]}, "ids")):
        with pytest.raises(MessageError, match=why):
            read_call(decode(encode(Message("serve-call", "label", "party0", 7, meta=meta))), "label", "party0")
    good = Message("serve-output", "party0", "label", 7, {"embedding": torch.ones(3, 4)}, meta={"request": 7})
    check_output(good, sender="party0", request=7, name="embedding", shape=(3, 4), dtype=torch.float32)
    bad = {"shape": good.replace(tensors={"embedding": torch.ones(3, 5)}),
           "float64": good.replace(tensors={"embedding": torch.ones(3, 4, dtype=torch.float64)}),
           "non-finite": good.replace(tensors={"embedding": torch.full((3, 4), float("nan"))}),
           "carries meta": good.replace(meta={"request": 6}),
           "holds tensors": good.replace(tensors={"embedding": torch.ones(3, 4), "x": torch.ones(1)})}
    for why, message in bad.items():
        with pytest.raises(MessageError, match=why.split("-")[0] if why != "shape" else "expected torch.float32"):
            check_output(message, sender="party0", request=7, name="embedding", shape=(3, 4), dtype=torch.float32)


def test_the_audit_log_is_append_only_and_its_chain_shows_a_removed_line(tmp_path: Path) -> None:
    from secvfl.serve.audit import AUDIT_FILE, AuditLog, verify_audit_log

    log = AuditLog(tmp_path, "shop")
    for r in range(3):
        log.write(coordinator="bank", request=r, op="embed", ids=[f"c{r}"], held=1)
    log.close()
    again = AuditLog(tmp_path, "shop")  # a restarted process appends to the same chain
    again.write(coordinator="bank", request=3, op="embed", ids=["c3"], held=0)
    again.close()
    path = tmp_path / AUDIT_FILE
    assert verify_audit_log(path) == 4
    lines = path.read_text().splitlines()
    assert [json.loads(x)["ids"] for x in lines] == [["c0"], ["c1"], ["c2"], ["c3"]]
    assert json.loads(lines[0])["coordinator"] == "bank" and oct(path.stat().st_mode)[-3:] == "600"
    path.write_text("\n".join(lines[:1] + lines[2:]) + "\n")
    with pytest.raises(ConfigError, match="line 2: its chain does not follow"):
        verify_audit_log(path)


def test_the_batcher_fills_batches_within_its_bounds_and_refuses_when_full() -> None:
    from secvfl.serve.batching import Batcher, DeadlineExceeded, QueueFull

    seen: list[list[str]] = []
    gate = threading.Event()

    def score(ids: list[str], left: float) -> list[str]:
        gate.wait(10)
        seen.append(ids)
        return [i.upper() for i in ids]

    b = Batcher(score, max_batch_ids=5, batch_wait_ms=50, max_queued_requests=4, log=lambda _: None)
    try:
        far = time.monotonic() + 30
        first = b.submit(["a"], far)  # taken by the worker, which waits at the gate
        time.sleep(0.2)
        futures = [b.submit(ids, far) for ids in (["b", "c"], ["c", "d"], ["e", "f", "g"], ["h"])]
        with pytest.raises(QueueFull, match="4 requests are waiting.*--max-queue 4"):
            b.submit(["x"], far)
        gate.set()
        (result, rows) = first.result(10)
        assert [result[i] for i in rows] == ["A"]
        got = [f.result(10) for f in futures]
        assert [[res[i] for i in rows] for res, rows in got] == [["B", "C"], ["C", "D"], ["E", "F", "G"], ["H"]]
        assert seen[1] == ["b", "c", "d"]  # two requests in one batch, their shared id scored once
        assert all(len(batch) <= 5 for batch in seen)  # ["e","f","g"] would overflow it: the next batch
        gate.clear()
        blocker = b.submit(["z"], far)
        late = b.submit(["y"], time.monotonic() + 0.05)
        time.sleep(0.3)
        gate.set()
        blocker.result(10)
        with pytest.raises(DeadlineExceeded, match="deadline passed while it waited"):
            late.result(10)
    finally:
        gate.set()
        b.close()


def test_client_certificates_chain_to_their_own_ca_for_client_auth_only(tmp_path: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    from secvfl.serve.clientcerts import issue_client_certificates, write_client_certificates

    write_client_certificates(issue_client_certificates(tmp_path, ["app"], days=30))
    write_client_certificates(issue_client_certificates(tmp_path, ["batch-job"], days=30))  # the same CA again
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    for name in ("app", "batch-job"):
        cert = x509.load_pem_x509_certificate((tmp_path / f"{name}.pem").read_bytes())
        ca.public_key().verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(cert.signature_hash_algorithm))
        assert cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value == \
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH])
        assert oct((tmp_path / f"{name}.key").stat().st_mode)[-3:] == "600"
    with pytest.raises(ConfigError, match="--clients takes names"):
        issue_client_certificates(tmp_path, ["a b"])


# The HTTP layer in this process, against a stand-in coordinator: every refusal and its status.
class _StubCoordinator:
    ready, classes, model_version = True, ["no", "yes"], "epoch-3"

    def describe(self) -> dict:
        return {"algorithm": "splitnn", "classes": self.classes, "epoch": 3, "parties": ["p0"], "protocols": []}


def _asgi(app, method: str, path: str, body: bytes = b"", client: str | None = "app") -> tuple[int, dict]:  # noqa: ANN001
    import asyncio

    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [(b"content-length", str(len(body)).encode())], "client": ("127.0.0.1", 5),
             "server": ("127.0.0.1", 1), "scheme": "https", "http_version": "1.1", "root_path": "",
             "_client": client}
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(data)


def test_every_bad_request_gets_a_4xx_with_one_reason(tmp_path: Path) -> None:
    from secvfl.serve.audit import AuditLog
    from secvfl.serve.batching import Batcher
    from secvfl.serve.coordinator import Scored, ServeLimits
    from secvfl.serve.http import make_app

    def score(ids: list[str], left: float) -> Scored:
        out = Scored.failed(len(ids), 2, "")
        out.probabilities[:] = [0.25, 0.75]
        out.unknown = {i for i, x in enumerate(ids) if x.startswith("nobody")}
        return out

    limits = ServeLimits(max_ids_per_request=3, max_queued_requests=1, max_body_bytes=2048)
    batcher = Batcher(score, max_batch_ids=8, batch_wait_ms=0, max_queued_requests=1, log=lambda _: None)
    app = make_app(_StubCoordinator(), batcher, model_name="m", limits=limits, audit=AuditLog(tmp_path, "label"),
                   client_of=lambda scope: scope["_client"], startup_error=lambda: "")

    def infer(ids: object, datatype: str = "BYTES", **extra: object) -> bytes:
        n = len(ids) if isinstance(ids, list) else 1
        return json.dumps({"inputs": [{"name": "entity_id", "datatype": datatype, "shape": [n], "data": ids}],
                           **extra}).encode()

    status, body = _asgi(app, "POST", "/v2/models/m/infer", infer(["c1", "c2"], id="r1"))
    assert status == 200 and body["id"] == "r1" and outputs(body)["predicted_class"] == ["yes", "yes"]
    cases = [
        ("/v2/models/m/infer", infer(["nobody1", "c2"]), "app", 404, "unknown entity id 'nobody1': no party holds"),
        ("/v2/models/m/infer", infer([]), "app", 400, "names no entity id"),
        ("/v2/models/m/infer", infer(["a", "b", "c", "d"]), "app", 413, "4 ids in one request, over the limit of 3"),
        ("/v2/models/m/infer", b'{"inputs": [', "app", 400, "not valid JSON"),
        ("/v2/models/m/infer", b'{"inputs": 3}', "app", 400, "not an Open Inference Protocol inference request"),
        ("/v2/models/other/infer", infer(["c1"]), "app", 404, "no model named 'other'; this server serves 'm'"),
        ("/v2/models/m/versions/epoch-9/infer", infer(["c1"]), "app", 404, "has no version 'epoch-9'"),
        ("/v2/models/m/infer", infer(["c1"]), None, 401, "needs a client certificate"),
        ("/v2/models/m/infer", infer([1, 2]), "app", 400, "entity id 1 is not a string"),
        ("/v2/models/m/infer", infer(["c1"], datatype="INT64"), "app", 400, "entity ids are strings: BYTES"),
        ("/v2/models/m/infer", infer(["c1"], parameters={"deadline_ms": -1}), "app", 400, "deadline_ms must be"),
        ("/v2/models/m/infer", infer(["c1"], parameters={"top_k": 1}), "app", 400, "unknown request parameters"),
        ("/v2/models/m/infer", infer(["x" * 300]), "app", 400, "is not a string of 1 to 256"),
        ("/v2/models/m/infer", b" " * 3000, "app", 413, "over the limit of 2048"),
    ]
    for path, body_bytes, client, code, reason in cases:
        status, body = _asgi(app, "POST", path, body_bytes, client)
        assert (status, list(body)) == (code, ["error"]), (reason, status, body)
        assert reason in body["error"] and "\n" not in body["error"], (reason, body)
    assert _asgi(app, "GET", "/v2/health/ready", client=None) == (200, {"ready": True})
    assert _asgi(app, "GET", "/v2/models/m", client="app")[1]["versions"] == ["epoch-3"]
    assert _asgi(app, "POST", "/v2/models/m/infer", infer(["c3"]))[0] == 200  # still serving
    batcher.close()
    status, body = _asgi(app, "POST", "/v2/models/m/infer", infer(["c3"]))
    assert status == 429 and "stopping" in body["error"]


# -- slow: federations trained with `secvfl launch`, served with `secvfl serve` -------------------------------------
def _demo(tmp: Path, dataset: str, *, aggregator: bool = False) -> Path:
    from secvfl.serve.demo import write_demo_federation

    write_demo_federation(tmp, dataset=dataset, parties=2, aggregator=aggregator)
    return tmp


@pytest.fixture(scope="module")
def served_splitnn(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    demo = _demo(tmp_path_factory.mktemp("splitnn"), "breast_cancer")
    _launch(demo / "federation.toml", demo / "run", "--algo", "splitnn", "--parties", "2", "--epochs", "2",
            "--secure-channel")
    served = Served(demo, demo / "run", "--max-ids", "64", "--deadline-ms", "20000")
    yield served
    served.close()


@pytest.fixture(scope="module")
def served_laser(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    demo = _demo(tmp_path_factory.mktemp("laser"), "breast_cancer")
    _launch(demo / "federation.toml", demo / "run", "--algo", "laser", "--parties", "2", "--epochs", "2",
            "--secure-channel")
    served = Served(demo, demo / "run", "--deadline-ms", "20000")
    yield served
    served.close()


def _check_equal(served: Served, tmp: Path, observed: list[int] | None = None) -> dict[str, np.ndarray]:
    expected = reference(served.demo, served.run, tmp, observed)
    ids = list(expected)
    got: dict[str, dict] = {}
    for start in range(0, len(ids), 40):
        status, body = served.infer(ids[start:start + 40])
        assert status == 200, body
        o = outputs(body)
        for j, ident in enumerate(ids[start:start + 40]):
            got[ident] = {k: (v[j] if k != "proba" else v[j]) for k, v in o.items()}
    classes = json.loads((served.run / "label" / "serving.json").read_text())["classes"]
    for ident in ids:
        assert got[ident]["error"] == "", got[ident]
        np.testing.assert_allclose(got[ident]["proba"], expected[ident], rtol=0, atol=1e-6)
        assert got[ident]["predicted_class"] == classes[int(np.argmax(got[ident]["proba"]))]
    return {i: got[i] for i in ids}


@pytest.mark.slow
def test_served_splitnn_equals_secvfl_predict_and_names_the_party_that_lacks_an_id(served_splitnn: Served,
                                                                                    tmp_path: Path) -> None:
    got = _check_equal(served_splitnn, tmp_path)
    assert {g["contributors"] for g in got.values()} == {"party0,party1"}
    status, body = served_splitnn.get("/v2/models/demo")  # every output reached the label party sealed
    assert status == 200 and body["parameters"]["protocols"] == ["secure-channel"]
    # an id the label party and party1 hold but party0 lacks (the demo files leave a few out at each party)
    _, rows0 = _read_csv(served_splitnn.demo / "party0.csv")
    _, rows1 = _read_csv(served_splitnn.demo / "party1.csv")
    lacking = sorted({r[0] for r in rows1} - {r[0] for r in rows0})[0]
    status, body = served_splitnn.infer([lacking, next(iter(got))])
    o = outputs(body)
    assert status == 200 and o["error"][0].startswith("not held by party0") and o["error"][1] == ""
    assert o["predicted_class"][0] == "" and o["proba"][0].tolist() == [0.0, 0.0]
    # each feature party's audit log names every id it was asked about, and who asked
    from secvfl.serve.audit import AUDIT_FILE, verify_audit_log

    for party in ("party0", "party1"):
        path = served_splitnn.run / party / AUDIT_FILE
        assert verify_audit_log(path) >= 1
        records = [json.loads(x) for x in path.read_text().splitlines()]
        assert {i for r in records for i in r["ids"]} >= set(got) | {lacking}
        assert {r["coordinator"] for r in records} == {"label"}
    label_log = [json.loads(x) for x in (served_splitnn.run / "label" / AUDIT_FILE).read_text().splitlines()]
    assert {r["client"] for r in label_log} == {"app"}


@pytest.mark.slow
def test_bad_requests_to_a_served_federation_get_a_4xx_and_it_stays_up(served_splitnn: Served) -> None:
    s = served_splitnn
    first = _read_csv(s.demo / "label.csv")[1][0][0]
    cases = [
        (s.infer(["no-such-customer"]), 404, "unknown entity id 'no-such-customer'"),
        (s.infer([]), 400, "names no entity id"),
        (s.infer([f"c{i:05d}" for i in range(65)]), 413, "65 ids in one request, over the limit of 64"),
        (s.post("/v2/models/demo/infer", b'{"inputs": [{"name": '), 400, "not valid JSON"),
        (s.post("/v2/models/other/infer", b"{}"), 404, "no model named 'other'"),
        (s.post("/v2/models/demo/infer", b"{}", s.connection(with_cert=False)), 401, "needs a client certificate"),
    ]
    for (status, body), code, reason in cases:
        assert status == code and list(body) == ["error"] and reason in body["error"], (code, status, body)
    status, body = s.infer([first])
    assert status == 200 and outputs(body)["error"] == [""]
    for name, proc in s.procs.items():
        assert proc.poll() is None, s.log(name)
    # a client certificate from another CA does not get past the TLS handshake
    from secvfl.serve.clientcerts import issue_client_certificates, write_client_certificates

    other = s.run.parent / "other-clients"
    write_client_certificates(issue_client_certificates(other, ["app"]))
    ctx = _client_context(s.demo, with_cert=False)
    ctx.load_cert_chain(str(other / "app.pem"), str(other / "app.key"))
    conn = http.client.HTTPSConnection("127.0.0.1", s.port, context=ctx, timeout=30)
    with pytest.raises((ssl.SSLError, ConnectionError)):
        conn.request("GET", "/v2/health/ready")
        conn.getresponse().read()
    assert s.infer([first])[0] == 200


@pytest.mark.slow
@pytest.mark.parametrize("protocol", [(), ("--he", "ckks")], ids=["vafl", "vafl-ckks"])
def test_served_vafl_equals_secvfl_predict(tmp_path: Path, protocol: tuple[str, ...]) -> None:
    """Each feature party serves a Parquet export of its table (``--table``) holding one more customer, whose row
    at party0 has a missing cell: trained with --nan-policy error, that id gets an error naming party0 and why,
    and every other id is served as `secvfl predict` scores it."""
    demo = _demo(tmp_path / "demo", "wine", aggregator=bool(protocol))
    _launch(demo / "federation.toml", demo / "run", "--algo", "vafl", "--parties", "2", "--epochs", "2",
            "--nan-policy", "error", *protocol)
    tables = {}
    for party in ("party0", "party1"):
        _, rows = _read_csv(demo / f"{party}.csv")
        cells = ["new-customer", *rows[0][1:]]
        if party == "party0":
            cells[1] = ""  # a missing cell: this party cannot score the id under --nan-policy error
        tables[party] = _as_parquet(demo / f"{party}.csv", tmp_path / f"{party}.parquet", (",".join(cells),))
    served = Served(demo, demo / "run", "--deadline-ms", "20000", tables=tables)
    try:
        got = _check_equal(served, tmp_path / "ref")
        status, body = served.get("/v2/models/demo")
        assert status == 200 and body["parameters"]["protocols"] == (["ckks"] if protocol else [])
        status, body = served.infer(["new-customer", next(iter(got))])
        o = outputs(body)
        assert status == 200 and o["error"][1] == "" and o["predicted_class"][0] == "", body
        assert o["error"][0] == ("party0 holds it but cannot score it (its row has a missing cell, or a category "
                                 "training never saw, and the model was trained with --nan-policy error) (vafl needs "
                                 "every party's features for an id)")
    finally:
        served.close()
    assert "1 row(s) with missing cells cannot be scored (--nan-policy error)" in served.log("party0")
    if protocol:  # the label party saw sums only: no party's output ever reached it alone
        assert "ckks" in (demo / "run" / "label" / "config.toml").read_text()


@pytest.mark.slow
def test_served_laser_equals_secvfl_predict(served_laser: Served, tmp_path: Path) -> None:
    got = _check_equal(served_laser, tmp_path, observed=[0, 1])
    assert {g["contributors"] for g in got.values()} == {"party0,party1"}
    assert {g["predictors"] for g in got.values()} == {"party0,party1"}


@pytest.mark.slow
def test_laser_answers_every_request_when_a_party_stops_mid_load(served_laser: Served, tmp_path: Path) -> None:
    s = served_laser
    expected = reference(s.demo, s.run, tmp_path, observed=[0])  # party1 gone: party0's own predictor
    ids = list(expected)
    results: list[tuple[float, int, dict]] = []

    def load() -> None:
        conn = s.connection()
        for k in range(80):
            status, body = s.infer([ids[k % len(ids)], ids[(k * 7 + 3) % len(ids)]], conn)
            results.append((time.monotonic(), status, body))

    client = threading.Thread(target=load)
    client.start()
    while len(results) < 10:
        time.sleep(0.02)
    killed = time.monotonic()
    s.kill("party1")
    client.join(timeout=300)
    assert len(results) == 80
    assert all(status == 200 and not any(outputs(body)["error"]) for _, status, body in results)
    assert any(t > killed and outputs(b)["contributors"][0] == "party0" for t, _, b in results)
    status, body = s.infer(ids)
    o = outputs(body)
    assert status == 200 and set(o["contributors"]) == {"party0"} and set(o["predictors"]) == {"party0"}
    np.testing.assert_allclose(o["proba"], np.stack([expected[i] for i in ids]), rtol=0, atol=1e-6)
    assert "party1 is gone" in s.log("label")


def _readme_block(heading: str) -> str:
    from conftest import REPO

    text = (REPO / "README.md").read_text()
    section = text[text.index(heading):]
    start = section.index("```bash\n") + len("```bash\n")
    return section[start:section.index("```", start)]


@pytest.mark.slow
def test_the_readme_serving_section_runs_as_printed(tmp_path: Path) -> None:
    block = _readme_block("## Serving a trained federation")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.Popen(["bash", "-e", "-c", block], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything the block left behind
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, err[-3000:]
    lines = out.strip().splitlines()
    assert lines[0].startswith("wrote ") and lines[1] == '{"ready":true}', out
    body = json.loads(lines[lines.index('{"ready":true}') + 1])
    o = outputs(body)
    assert body["model_name"] == "demo" and body["parameters"]["classes"] == ["benign", "malignant"]
    assert o["error"] == ["", ""] and o["contributors"] == ["party0,party1"] * 2
    assert o["predicted_class"] == ["malignant", "benign"]  # c00001 and c00019 in the dataset
    assert np.allclose(o["proba"].sum(axis=1), 1.0, atol=1e-6)
    assert o["predicted_class"] == [["benign", "malignant"][int(k)] for k in np.argmax(o["proba"], axis=1)]


def test_bench_serve_percentiles_are_nearest_rank() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from secvfl.bench.serve import percentile

    @settings(max_examples=100, deadline=None)
    @given(st.lists(st.floats(0, 1e3, allow_nan=False), min_size=1, max_size=50), st.sampled_from([1, 50, 99, 100]))
    def check(values: list[float], q: int) -> None:
        assert percentile(values, q) == np.percentile(values, q, method="inverted_cdf")

    check()
