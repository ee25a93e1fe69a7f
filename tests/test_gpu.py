"""The CUDA path, checked against the same computation on the CPU.

Every test here carries the ``gpu`` marker: where torch finds no CUDA device they are skipped, and the end of the run
counts them (tests/conftest.py). ``scripts/gpu-check.sh`` runs them on a GPU machine (``python -m pytest -m gpu``).
What they check: messages encoded from device tensors are the bytes of the host tensors; the copies in do not wait for
the device; a training step waits only once per send and once for its loss; split-NN, VIMADMM, CKKS, masking and
label DP train on CUDA to the CPU's results (identical byte counts, metrics within float tolerance); a run moves
between CUDA and the CPU on resume; the image bottoms compute the same on both.
"""

from __future__ import annotations

import json
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from protocols.ckks import pack
from protocols.dp.rng import SeededNoise
from secvfl.config import TrainConfig
from secvfl.device import index_tensor, to_device, to_host
from secvfl.io import torch_load
from secvfl.messages import Message, encode, encode_many
from secvfl.models import make_bottom
from secvfl.parties import make_optimizer
from secvfl.runner import build_run, run_training

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
QUIET = {"progress": False, "log": lambda *_: None}


def _cfg(device: str, **kw) -> TrainConfig:
    base = dict(dataset="digits", parties=4, epochs=3, batch_size=64, seed=1, threads=1, device=device)
    return TrainConfig(**{**base, **kw})


def _close(cuda: dict, cpu: dict, tol: float = 0.02, *, exact_bytes: bool = True) -> None:
    """The same bytes, and test metrics within ``tol`` (float rounding on another device, compounded over steps).
    ``exact_bytes=False`` (CKKS): SEAL compresses each random ciphertext, a few bytes differently from run to run."""
    if exact_bytes:
        assert cuda["comm"] == cpu["comm"]
    else:
        assert cuda["comm"]["messages_total"] == cpu["comm"]["messages_total"]
        assert abs(cuda["comm"]["bytes_total"] - cpu["comm"]["bytes_total"]) <= 1e-3 * cpu["comm"]["bytes_total"]
    assert cuda["device"].startswith("cuda") and cpu["device"] == "cpu"
    for key, want in cpu["metrics"]["test"].items():
        assert abs(cuda["metrics"]["test"][key] - want) <= tol, (key, cuda["metrics"]["test"][key], want)


# -- messages and copies ---------------------------------------------------------------------------------------
def test_a_message_of_device_tensors_is_the_bytes_of_the_host_tensors() -> None:
    g = torch.Generator().manual_seed(0)
    host = {"f32": torch.randn(64, 16, generator=g), "f64": torch.randn(3, 5, generator=g, dtype=torch.float64),
            "bf16": torch.randn(7, generator=g).to(torch.bfloat16), "i64": torch.arange(10),
            "mask": torch.tensor([True, False, True]), "u8": torch.arange(5, dtype=torch.uint8),
            "t": torch.randn(6, 4, generator=g).t(),  # not contiguous
            "empty": torch.zeros(0, 3)}
    on_gpu = {k: v.to(CUDA) for k, v in host.items()}
    assert encode(Message("embedding", "party0", "label", 3, on_gpu)) == \
        encode(Message("embedding", "party0", "label", 3, host))
    shared = on_gpu["f32"]
    many = [Message("gradient", "label", f"party{k}", 3, {"gradient": shared}) for k in range(4)]
    assert encode_many(many) == [encode(Message("gradient", "label", f"party{k}", 3, {"gradient": host["f32"]}))
                                 for k in range(4)]
    copies = to_host([shared, shared, host["i64"]])
    assert copies[0] is copies[1] and copies[0].is_pinned() and copies[2] is host["i64"]


def test_copies_in_keep_the_values_and_do_not_wait_for_the_device() -> None:
    x = torch.randn(512, 64)
    ids = np.array([5, 1, 7, 3])
    torch.cuda.set_sync_debug_mode("error")  # a synchronising call raises
    try:
        busy = torch.randn(2048, 2048, device=CUDA) @ torch.randn(2048, 2048, device=CUDA)  # work queued before
        moved = to_device(x, CUDA, torch.float64)
        idx = index_tensor(ids, CUDA)
        picked = moved[idx]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert busy.shape == (2048, 2048)
    assert torch.equal(picked.cpu(), x.to(torch.float64)[torch.as_tensor(ids)])


def test_a_training_step_waits_once_per_send_and_once_for_its_loss() -> None:
    run = build_run(_cfg("cuda", dataset="wine", parties=3, batch_size=32, epochs=1, val_fraction=0, hidden=(8,),
                         embedding_dim=4))
    steps, k = run.algorithm.batches_per_epoch(), 3
    run.algorithm.train_epoch(0)  # warm-up: the first step allocates (pinned buffers, kernels)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run.algorithm.train_epoch(1)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    sites = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    assert sum(sites.values()) <= steps * (k + 2), f"{sum(sites.values())} waits in {steps} steps: {dict(sites)}"


def test_optimisers_on_cuda_use_the_fused_kernels_and_step_as_the_cpu() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.ReLU(), torch.nn.Linear(30, 4))
    twin = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    model.to(CUDA)
    for name in ("adam", "sgd", "adamw"):
        fused = make_optimizer(model.parameters(), name, 1e-2, 1e-3, device=CUDA)
        assert fused.defaults["fused"] is True
    opt = make_optimizer(model.parameters(), "adam", 1e-2, 1e-3, device=CUDA)
    ref = make_optimizer(twin, "adam", 1e-2, 1e-3, device=torch.device("cpu"))
    for step in range(5):
        grads = [torch.randn_like(p, device="cpu") * (step + 1) for p in twin]
        for p, q, gr in zip(model.parameters(), twin, grads, strict=True):
            p.grad, q.grad = gr.to(CUDA), gr.clone()
        opt.step()
        ref.step()
    for p, q in zip(model.parameters(), twin, strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6)


# -- training runs on CUDA against the CPU -------------------------------------------------------------------------
@pytest.mark.parametrize("bottom", ["mlp", "cnn"])
def test_split_nn_on_cuda_gives_the_cpu_run(bottom: str) -> None:
    cuda = run_training(_cfg("cuda", bottom=bottom), **QUIET)
    cpu = run_training(_cfg("cpu", bottom=bottom), **QUIET)
    _close(cuda, cpu)
    assert cpu["metrics"]["test"]["accuracy"] > 0.5  # the reference learnt something (chance: 0.1)


def test_vimadmm_on_cuda_gives_the_cpu_run() -> None:
    kw = dict(algo="vimadmm", epochs=1, options={"vim_local_steps": 5})
    cuda = run_training(_cfg("cuda", **kw), **QUIET)
    cpu = run_training(_cfg("cpu", **kw), **QUIET)
    _close(cuda, cpu, tol=0.03)


def test_laser_on_cuda_gives_the_cpu_run() -> None:
    kw = dict(algo="laser", epochs=2, lr=0.01, p_miss_train="0.3", p_miss_test="0.3")
    _close(run_training(_cfg("cuda", **kw), **QUIET), run_training(_cfg("cpu", **kw), **QUIET), tol=0.03)


def test_ckks_is_fed_from_gpu_tensors_and_trains_as_on_the_cpu() -> None:
    g = torch.Generator().manual_seed(2)
    tensors = {"a": torch.randn(64, 16, generator=g), "b": torch.randn(5, generator=g, dtype=torch.float64)}
    for got, want in zip(pack({k: v.to(CUDA) for k, v in tensors.items()}, 1000), pack(tensors, 1000), strict=True):
        assert np.array_equal(got, want)
    kw = dict(algo="vafl", dataset="breast_cancer", parties=3, epochs=2, options={"he": "ckks"})
    _close(run_training(_cfg("cuda", **kw), **QUIET), run_training(_cfg("cpu", **kw), **QUIET), exact_bytes=False)


def test_masked_aggregation_trains_on_cuda_as_on_the_cpu() -> None:
    kw = dict(algo="vafl", dataset="wine", parties=3, epochs=20, options={"secagg": "mask", "secure_channel": True})
    _close(run_training(_cfg("cuda", **kw), **QUIET), run_training(_cfg("cpu", **kw), **QUIET), tol=0.05)


def test_dp_noise_is_added_on_the_device_as_on_the_host() -> None:
    x = torch.randn(300, 7)
    on_gpu = SeededNoise(5).derive("t").add_gaussian(x.to(CUDA), 0.7)
    on_cpu = SeededNoise(5).derive("t").add_gaussian(x, 0.7)
    assert on_gpu.device.type == "cuda" and torch.equal(on_gpu.cpu(), on_cpu)  # one float64 sum, rounded once
    kw = dict(dataset="breast_cancer", parties=2, epochs=2,
              options={"privacy": "dp", "epsilon": 3.0, "dp_mechanism": "gradient", "dp_reproducible": True})
    _close(run_training(_cfg("cuda", **kw), **QUIET), run_training(_cfg("cpu", **kw), **QUIET), tol=0.05)


def test_a_run_moves_from_cuda_to_the_cpu_and_back_on_resume(tmp_path: Path) -> None:
    """A run trained on a GPU goes on on the CPU (its checkpoint is read on the CPU) and back on CUDA: the byte counts
    of an uninterrupted CUDA run, its metrics within float tolerance."""
    kw = dict(dataset="breast_cancer", parties=2, epochs=3)
    full = run_training(_cfg("cuda", **kw), out=tmp_path / "full", **QUIET)
    run_training(_cfg("cuda", **{**kw, "epochs": 1}), out=tmp_path / "moved", **QUIET)
    state = torch_load(next((tmp_path / "moved" / "checkpoints" / "epoch-0001").glob("party-party0.pt")))
    assert all(t.device.type == "cpu" for t in state["model"].values())  # readable where there is no GPU
    on_cpu = run_training(TrainConfig(), resume=tmp_path / "moved", changes={"epochs": 2, "device": "cpu"}, **QUIET)
    assert on_cpu["device"] == "cpu"
    back = run_training(TrainConfig(), resume=tmp_path / "moved", changes={"epochs": 3, "device": "cuda"}, **QUIET)
    assert back["device"].startswith("cuda") and back["comm"] == full["comm"]
    for key, want in full["metrics"]["test"].items():
        assert abs(back["metrics"]["test"][key] - want) <= 0.02, key
    history = [json.loads(line) for line in (tmp_path / "moved" / "metrics.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in history] == [1, 2, 3]


@pytest.mark.parametrize("kind, shape", [("cnn", (1, 14, 14)), ("resnet", (3, 16, 16)), ("resnet", (1, 14, 14))])
def test_image_bottoms_compute_the_same_on_cuda(kind: str, shape: tuple[int, int, int]) -> None:
    torch.manual_seed(0)
    c, h, w = shape
    model = make_bottom(kind, c * h * w, 16, [32], (h, w), channels=c).eval()
    x = torch.randn(8, c * h * w)
    want = model(x)
    got = model.to(CUDA)(x.to(CUDA)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_party_s_own_non_finite_cuda_output_is_stopped_before_it_is_sent() -> None:
    """The send-side check on CUDA (secvfl.transport.guard.SentSums): sums copied without a wait, read after the
    send's one wait; a finite embedding goes out, a non-finite one stops the run naming the sender and its cause.
    The network is party0's own process's (``local``): with every party in one process the receiver's check would
    be the sender's."""
    from secvfl.errors import TrainingDiverged
    from secvfl.transport.guard import ReceiveGuard
    from secvfl.transport.inprocess import InProcessTransport
    from secvfl.transport.layers import Role
    from secvfl.transport.network import Network

    net = Network({"label": Role.LABEL, "party0": Role.FEATURE}, transport=InProcessTransport(), local="party0")
    net.guard = ReceiveGuard(["embedding"], ["gradient"])  # as an algorithm with embeddings declares it
    good = torch.randn(64, 16, device="cuda")
    net.send(Message("embedding", "party0", "label", 0, {"embedding": good}))
    got = net.receive("label", kind="embedding", sender="party0").tensor("embedding")
    assert torch.equal(got, good.cpu())
    bad = good.clone()
    bad[3, 5] = float("nan")
    with pytest.raises(TrainingDiverged, match="party0's embedding became non-finite at step 1"):
        net.send(Message("embedding", "party0", "label", 1, {"embedding": bad}))
    assert net.transport.pending("label") == 0
