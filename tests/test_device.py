"""The device path: where a training step reads tensors back to the host, and the copies of :mod:`secvfl.device`.

On a GPU every read of a tensor's values by the host (``float(t)``, ``.item()``, ``.tolist()``, ``.numpy()``, a copy
to the CPU, an operation whose output size depends on the values) waits for all the work queued before it. The tests
here run on the CPU and count those reads by the secvfl function that makes them (:class:`HostReads`), so they hold
on any machine: a training step may read only what the wire format and the coordinator need. The ``gpu``-marked tests
(``tests/test_gpu.py``) check the same paths on CUDA.
"""

from __future__ import annotations

import copy
import functools
import sys
from collections import Counter

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

import secvfl.messages
from secvfl.algorithms.vim import parties as vim_parties
from secvfl.algorithms.vim.parties import ADMMFeatureParty, _DeviceLocalSteps, _LocalSteps
from secvfl.algorithms.vim.zsolve import (
    _gradient_and_hessian,
    _halvings,
    _halvings_at_once,
    solve_z,
    z_objective,
)
from secvfl.config import TrainConfig
from secvfl.device import index_tensor, to_device, to_host
from secvfl.messages import Message, decode, encode, encode_many
from secvfl.parties import make_optimizer
from secvfl.runner import build_run

_READS = {"__float__", "__int__", "__bool__", "__index__", "__array__", "item", "tolist", "numpy", "cpu", "nonzero",
          "masked_select", "unique", "argwhere"}


def _site() -> str:
    """The secvfl (or protocols) function that made the read; ``torch.optim`` for reads inside an optimiser."""
    frame = sys._getframe(2)
    inside_optim = False
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("torch.optim"):
            inside_optim = True
        elif name.startswith(("secvfl", "protocols")):
            return "torch.optim" if inside_optim else f"{name}:{frame.f_code.co_qualname}"
        frame = frame.f_back
    return "elsewhere"


class HostReads(TorchFunctionMode):
    """Counts the host reads of tensors (on a GPU: host waits), by the function that makes them."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = getattr(func, "__name__", "")
        boolean_index = name == "__getitem__" and len(args) > 1 and any(
            isinstance(i, torch.Tensor) and i.dtype is torch.bool
            for i in (args[1] if isinstance(args[1], tuple) else (args[1],)))
        if name in _READS or boolean_index:
            self.sites[_site()] += 1
        return func(*args, **(kwargs or {}))


def _count_to_host(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the calls of to_host that encode makes (one wait each on a GPU): returns a list holding the count."""
    calls = [0]

    def counted(tensors):  # noqa: ANN001, ANN202
        calls[0] += 1
        return to_host(tensors)

    monkeypatch.setattr(secvfl.messages, "to_host", counted)
    return calls


def _pop_guard_reads(sites: dict[str, int], aggregates: int = 0) -> None:
    """The receive guard reads no tensor through torch here: the finiteness of each tensor a party receives comes
    from the sums of squares ``decode`` computed on the bytes it read (``secvfl.messages.square_sums``). In one
    process, with the plain in-process transport and no layer, that check is also the sender's check of its own
    output (``Network.send``), which is not made a second time; a party sending to another process checks what it
    sends from the bytes ``encode_many`` wrote (on CUDA summed on the device, copied without a wait and read after
    the send's one wait: ``secvfl.transport.guard.SentSums``; tests/test_gpu.py). What it reads is the check of
    sums built in this process (an aggregation's result: ``aggregates`` of them), one read each."""
    guard = {site: sites.pop(site) for site in list(sites) if site.startswith("secvfl.transport.guard:")}
    assert guard == ({"secvfl.transport.guard:ReceiveGuard.check": aggregates} if aggregates else {})


# -- the copies (CPU semantics; CUDA in test_gpu.py) -----------------------------------------------------------------
def test_on_the_cpu_the_copies_are_the_plain_operations() -> None:
    t = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    assert to_device(t, torch.device("cpu")) is t  # no copy
    assert to_device(t, torch.device("cpu"), torch.float32).dtype is torch.float32
    ids = np.array([4, 0, 2])
    idx = index_tensor(ids, torch.device("cpu"))
    assert idx.dtype is torch.int64 and idx.tolist() == [4, 0, 2]
    w = torch.ones(2, requires_grad=True)
    assert to_host([t, w, t]) == [t, w, t]  # host tensors come back as they are


def test_encode_many_gives_each_message_its_own_encoding_and_refuses_all_or_nothing() -> None:
    g = torch.randn(4, 3)
    messages = [Message("gradient", "label", f"party{k}", 7, {"gradient": g}) for k in range(3)]
    assert encode_many(messages) == [encode(m) for m in messages]
    bad = Message("gradient", "label", "party9", 7, {"gradient": np.ones(2)})  # not a tensor
    with pytest.raises(secvfl.messages.MessageError, match="not a torch.Tensor"):
        encode_many([messages[0], bad])
    assert encode_many([]) == []


# -- host reads per training step --------------------------------------------------------------------------------
@pytest.mark.parametrize("algo", ["splitnn", "vafl"])
def test_a_split_training_step_reads_only_the_bytes_it_sends_and_its_loss(algo: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Per step: one host copy per send (K embeddings, then the K gradients in one send), the sent tensors' bytes,
    and the loss once, after the gradients are sent. Nothing else: a new ``.item()`` in the step fails here."""
    run = build_run(TrainConfig(algo=algo, dataset="wine", parties=3, batch_size=32, epochs=1, val_fraction=0,
                                hidden=(8,), embedding_dim=4, head_hidden=(), device="cpu"))
    steps = run.algorithm.batches_per_epoch()
    sends = _count_to_host(monkeypatch)
    with HostReads() as reads:
        run.algorithm.train_epoch(0)
    k = 3
    assert sends[0] == steps * (k + 1)
    sites = dict(reads.sites)
    _pop_guard_reads(sites, aggregates=steps if algo == "vafl" else 0)  # (vafl sums the embeddings)
    sites.pop("torch.optim", None)  # Adam's CPU loop reads its step counter; CUDA uses the fused kernels
    assert sites == {"secvfl.messages:_tensor_bytes": steps * 2 * k,
                     "secvfl.handles:LabelHandle.train_step": steps}


def test_a_vimadmm_round_on_the_device_path_reads_no_local_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """VIMADMM with the device decisions (the GPU's path, here on the CPU): the tau local steps read nothing, the
    z-update reads one vector of checks and one number per Newton step, the head step whether it descended, the round
    its loss once."""
    run = build_run(TrainConfig(algo="vimadmm", dataset="wine", parties=2, batch_size=32, epochs=1, val_fraction=0,
                                hidden=(8,), embedding_dim=4, device="cpu", options={"vim_local_steps": 5}))
    for party in run.algorithm.feature_parties:
        party.steps_on_device = True
    monkeypatch.setattr(vim_parties, "solve_z", functools.partial(solve_z, line_search_at_once=True))
    label = run.algorithm.label_party
    rounds = run.algorithm.batches_per_epoch()
    with HostReads() as reads:
        run.algorithm.train_epoch(0)
    sites = dict(reads.sites)
    _pop_guard_reads(sites)
    sent_tensors = rounds * 2 * 3  # per party: a dual message (dual, residual) and a head message (weight)
    assert sites.pop("secvfl.messages:_tensor_bytes") == sent_tensors + rounds * 2  # + the parties' embeddings
    assert sites.pop("secvfl.algorithms.vim.handles:ADMMLabelHandle.admm_step") == rounds
    assert sites.pop("secvfl.algorithms.vim.zsolve:solve_z") == rounds * 2 + label.newton_steps
    assert sites.pop("secvfl.algorithms.vim.parties:ADMMLabelParty._head_step") == rounds  # did the step descend?
    assert sites == {}


# -- the device decisions give the host path's numbers -----------------------------------------------------------
def _blow_up_run(steps_cls: type, value_of, lr: float) -> tuple[torch.Tensor, int, int, float, float]:  # noqa: ANN001
    """20 safeguarded steps on f(p) = a/2 p^2: at lr 2.5 (lr a = 5) plain momentum blows up and the safeguard restarts
    and halves; at lr 25 every blown-up step is undone too (see test_vim_algorithms)."""
    a = 2.0
    p = torch.nn.Parameter(torch.tensor([1.0, -0.5], dtype=torch.float64))
    opt = torch.optim.SGD([p], lr=lr, momentum=0.9, weight_decay=0.01)
    steps = steps_cls(opt)
    for _ in range(20):
        opt.zero_grad()
        value = a / 2 * (p ** 2).sum()
        value.backward()
        steps.step(value_of(value.detach()))
    steps.restore()
    return p.detach().clone(), steps.restarts, steps.rejected, opt.param_groups[0]["lr"], \
        opt.param_groups[0]["weight_decay"]


@pytest.mark.parametrize("lr", [2.5, 25.0])
def test_the_local_steps_decided_on_the_device_move_the_parameters_as_the_host_decisions(lr: float) -> None:
    host = _blow_up_run(_LocalSteps, float, lr)
    device = _blow_up_run(_DeviceLocalSteps, lambda v: v, lr)
    assert host[1] >= 2  # the safeguard acted (restarts, and a halving: the blow-up needs it)
    assert lr < 10 or host[2] >= 1  # at lr 25 steps were undone
    assert torch.equal(host[0], device[0])  # bit for bit: the step factor is a power of two
    assert device[1:] == host[1:] and host[3:] == (lr, 0.01)  # same restarts and undos; step size, decay restored


def test_the_joint_local_steps_with_a_head_optimiser_move_as_the_host_decisions() -> None:
    """VIMADMM-J's round: the party's own head steps first (through step_other), then the bottom model; a blow-up
    undoes both and halves both step sizes. The device decisions give the host's parameters bit for bit."""
    def run(steps_cls: type, value_of) -> list[torch.Tensor]:  # noqa: ANN001
        bottom = torch.nn.Parameter(torch.tensor([1.0, -0.5], dtype=torch.float64))
        head = torch.nn.Parameter(torch.tensor([0.8], dtype=torch.float64))
        opt_bottom = torch.optim.SGD([bottom], lr=6.0, momentum=0.9, weight_decay=0.01)
        opt_head = torch.optim.SGD([head], lr=6.0, momentum=0.9, weight_decay=0.01)
        steps = steps_cls(opt_bottom, opt_head)
        for _ in range(20):
            opt_head.zero_grad()
            (((bottom.detach() * head) ** 2).sum() / 2 + (head - 1) ** 2).sum().backward()
            steps.step_other(opt_head)
            opt_bottom.zero_grad()
            value = (((bottom * head.detach()) ** 2).sum() / 2 + (head.detach() - 1) ** 2).sum()
            value.backward()
            steps.step(value_of(value.detach()))
        steps.restore()
        assert steps.rejected >= 1  # the test has power: a step was undone
        return [bottom.detach().clone(), head.detach().clone(), torch.tensor(opt_head.param_groups[0]["lr"])]

    host, device = run(_LocalSteps, float), run(_DeviceLocalSteps, lambda v: v)
    for a, b in zip(host, device, strict=True):
        assert torch.equal(a, b)


def test_a_vim_party_round_is_the_same_on_the_device_path() -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 5)).astype(np.float32)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4))
    lam, res = rng.normal(size=(16, 3)), rng.normal(scale=3, size=(16, 3))
    weight = torch.as_tensor(rng.normal(size=(4, 3)), dtype=torch.float32)
    models = []
    for on_device in (False, True):
        m = copy.deepcopy(model)
        party = ADMMFeatureParty("party0", {"train": x}, m, torch.optim.SGD(m.parameters(), lr=0.3, momentum=0.9,
                                                                              weight_decay=0.005),
                                 rho=1.0, local_steps=20, joint=False, algo="test", device=torch.device("cpu"))
        party.steps_on_device = on_device
        party.forward(0, "train", np.arange(16), "label")
        dual = decode(encode(Message("dual", "label", "party0", 0, {"dual": torch.as_tensor(lam, dtype=torch.float32),
                                                                    "residual": torch.as_tensor(res, dtype=torch.float32)})))
        head = decode(encode(Message("head", "label", "party0", 0, {"weight": weight})))
        party.local_update(dual, head)
        models.append(m)
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_the_line_search_tried_at_once_takes_the_same_steps() -> None:
    """Outputs of size ~10 and a small rho, where Newton's first full step overshoots for many samples and the line
    search halves (to 1/4 for some): every halving tried at once gives each sample the step length of halving one at
    a time, and the z-update ends at the same point."""
    g = torch.Generator().manual_seed(3)
    for c in (1, 10):
        v = torch.randn(200, c, generator=g, dtype=torch.float64) * 10
        lam = torch.randn(200, c, generator=g, dtype=torch.float64) * 0.1
        y = torch.randint(0, max(c, 2), (200,), generator=g)
        rho, z = 0.02, v.clone()
        grad, hess = _gradient_and_hessian(z, v, lam, y, rho)
        direction = -torch.linalg.solve(hess, grad[:, :, None])[:, :, 0]
        f0 = z_objective(z, v, lam, y, rho)
        slope = (grad * direction).sum(dim=1)
        rounding = 8 * torch.finfo(torch.float64).eps * (1 + f0.abs())
        one_by_one = _halvings(z, direction, f0, slope, rounding, v, lam, y, rho)
        at_once = _halvings_at_once(z, direction, f0, slope, rounding, v, lam, y, rho)
        assert (one_by_one < 1).any() and torch.equal(one_by_one, at_once)
        a, na = solve_z(v, lam, y, rho)
        b, nb = solve_z(v, lam, y, rho, line_search_at_once=True)
        assert na == nb and torch.equal(a, b)


def test_optimisers_use_the_fused_kernels_only_on_cuda() -> None:
    p = [torch.nn.Parameter(torch.zeros(3))]
    assert not make_optimizer(p, "adam", 1e-3, device=torch.device("cpu")).defaults.get("fused")
    assert not make_optimizer(p, "sgd", 1e-3).defaults.get("fused")


def test_a_laser_step_reads_only_the_bytes_it_sends_and_its_losses(monkeypatch: pytest.MonkeyPatch) -> None:
    """LASER-VFL: every observed party sends its representation to each peer and a gradient back, and reads its
    loss once after sending; the optimiser's step counts live on the host (no device read)."""
    run = build_run(TrainConfig(algo="laser", dataset="wine", parties=3, batch_size=32, epochs=1, val_fraction=0,
                                hidden=(8,), embedding_dim=4, head_hidden=(), device="cpu"))
    steps, k = run.algorithm.batches_per_epoch(), 3
    with HostReads() as reads:
        run.algorithm.train_epoch(0)
    sites = dict(reads.sites)
    _pop_guard_reads(sites)
    assert sites.pop("secvfl.algorithms.missing.base:FlatOptimizer.step") == steps * k  # float(self.steps[0]), host
    assert sites.pop("secvfl.algorithms.missing.subsets:TaskTable.__init__") == k  # a host table, once per pattern
    assert sites == {"secvfl.messages:_tensor_bytes": steps * k * (k - 1) * 2,
                     "secvfl.algorithms.missing.laser:LaserHandle.train_heads": steps * k}


def test_a_run_trained_on_a_gpu_is_read_on_any_machine(tmp_path) -> None:  # noqa: ANN001
    """A run directory whose config.toml says --device cuda (trained on a GPU machine): secvfl predict and the attacks
    read it on a machine without one, on the CPU (its checkpoint loads there); where CUDA exists they keep it."""
    from attacks.harness import load_recorded
    from secvfl.cli.main import main
    from secvfl.device import device_here

    run = tmp_path / "run"
    assert main(["train", "--algo", "laser", "--dataset", "wine", "--parties", "2", "--epochs", "1", "--hidden", "8",
                 "--device", "cpu", "--no-progress", "--out", str(run)]) == 0
    config = run / "config.toml"
    config.write_text(config.read_text().replace('device = "cpu"', 'device = "cuda"'))
    here = "cuda" if torch.cuda.is_available() else "cpu"
    assert device_here("cuda") == here and device_here("cpu") == "cpu" and device_here("auto") == "auto"
    assert main(["predict", "--run", str(run), "--observed", "0", "--out", str(tmp_path / "p.csv")]) == 0
    assert load_recorded(run).run.ctx.device.type == here
