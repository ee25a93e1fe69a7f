"""The messages of serving: the coordinator's calls, the parties' answers, the parties' model outputs.

Three message kinds, declared in the registry of :mod:`secvfl.messages`:

* ``serve-call`` (coordinator -> party, control traffic under the federation's mutual TLS): one request of the
  coordinator, its fields in ``meta`` -- ``op`` (hello, start, embed, represent, predict, stop), the request number,
  the entity ids to score (a party looks them up in its own table), the time left to answer;
* ``serve-answer`` (party -> coordinator, control): what the party did -- which of the ids it does not hold, or why it
  failed; LASER-VFL parties add their predictors' class probabilities, one tensor per group of ids;
* ``serve-output`` (through the run's network, so every protocol layer applies: sealed end to end under
  ``--secure-channel``, summed under ``--he ckks`` / ``--secagg mask``): a party's model output for the ids of one
  request (split algorithms: to the coordinator; LASER-VFL: to the other parties of a group).

Every field is decoded with msgspec into the exact types below (no coercion), so a malformed call or answer is
refused with the field it gets wrong; tensors are checked against what was asked for (sender, request, shape =
ids x agreed width, dtype, finite) by :func:`check_output`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

import msgspec
import torch

from secvfl.errors import MessageError
from secvfl.messages import Message, register_kind

__all__ = ["SERVE_CALL", "SERVE_ANSWER", "SERVE_OUTPUT", "Call", "Answer", "Group", "call_message", "read_call",
           "answer_message", "read_answer", "check_output", "MAX_ID_CHARS"]

SERVE_CALL = register_kind("serve-call")
SERVE_ANSWER = register_kind("serve-answer")
SERVE_OUTPUT = register_kind("serve-output")

MAX_ID_CHARS = 256  # an entity id, as the parties' tables hold it
_Id = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
_Index = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=2**62)]
_Op = Literal["hello", "start", "embed", "represent", "predict", "stop"]


class Group(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    """LASER-VFL: the ids (positions in the request's id list) whose observed parties are ``members``."""

    index: _Index
    members: list[_Index]
    rows: list[_Index]


class Call(msgspec.Struct, forbid_unknown_fields=True, frozen=True, omit_defaults=True):
    op: _Op
    request: _Count
    step: _Count = 0
    ids: list[_Id] = []
    budget_ms: Annotated[float, msgspec.Meta(ge=0, le=3.6e6)] = 0.0
    groups: list[Group] = []
    epoch: _Count = 0
    # hello: the run's settings and what this party loads
    config: dict[str, Any] = {}
    widths: list[_Index] = []
    n_classes: _Index = 0
    state: dict[str, str] = {}
    max_ids: _Count = 0


class Answer(msgspec.Struct, forbid_unknown_fields=True, frozen=True, omit_defaults=True):
    op: _Op
    request: _Count
    error: str = ""
    missing: list[_Index] = []  # positions of the ids the party does not hold (or cannot score)
    unusable: list[_Index] = []  # of those, the ones it holds but cannot score (a missing cell, --nan-policy error)
    failed: dict[str, str] = {}  # LASER-VFL predict: group index -> why it failed
    facts: dict[str, Any] = {}  # hello: rows held, width


def call_message(sender: str, receiver: str, call: Call) -> Message:
    return Message(SERVE_CALL, sender, receiver, call.request, meta=msgspec.to_builtins(call))


def _read(message: Message, kind: str, sender: str, receiver: str, typ: type) -> Any:
    if (message.kind, message.sender, message.receiver) != (kind, sender, receiver):
        raise MessageError(f"{receiver} expected a {kind} message from {sender}, got a {message.kind} message from "
                           f"{message.sender} to {message.receiver}")
    try:
        value = msgspec.convert(dict(message.meta), type=typ, strict=True)
    except msgspec.ValidationError as exc:
        raise MessageError(f"malformed {kind} message from {sender}: {exc}") from None
    if value.request != message.step:
        raise MessageError(f"malformed {kind} message from {sender}: request {value.request} in a message of step "
                           f"{message.step}")
    return value


def read_call(message: Message, coordinator: str, me: str) -> Call:
    """The coordinator's call, checked: only the coordinator calls, only with the fields of :class:`Call`."""
    return _read(message, SERVE_CALL, coordinator, me, Call)


def answer_message(sender: str, receiver: str, answer: Answer, tensors: Mapping[str, torch.Tensor] | None = None
                   ) -> Message:
    return Message(SERVE_ANSWER, sender, receiver, answer.request,
                   {k: v.detach().cpu().contiguous() for k, v in (tensors or {}).items()},
                   meta=msgspec.to_builtins(answer))


def read_answer(message: Message, party: str, me: str) -> Answer:
    return _read(message, SERVE_ANSWER, party, me, Answer)


def check_output(message: Message, *, sender: str, request: int, name: str, shape: Sequence[int],
                 dtype: torch.dtype, extra_meta: Mapping[str, Any] | None = None) -> torch.Tensor:
    """The one tensor ``name`` of a party's output for ``request``: of ``shape`` and ``dtype``, finite. Anything else
    raises :class:`MessageError` naming the sender and what is wrong."""
    where = f"{sender}'s output for request {request}"
    if message.sender != sender:
        raise MessageError(f"{where} came from {message.sender}")
    expected_meta = {"request": request, **(extra_meta or {})}
    if dict(message.meta) != expected_meta:
        raise MessageError(f"{where} carries meta {dict(message.meta)}, expected {expected_meta}")
    if list(message.tensors) != [name] or message.blobs:
        raise MessageError(f"{where} holds tensors {list(message.tensors)}, expected only {name!r}")
    t = message.tensors[name]
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise MessageError(f"{where} is {t.dtype} {tuple(t.shape)}, expected {dtype} {tuple(shape)} (ids x the width "
                           "agreed at training)")
    if not bool(torch.isfinite(t).all()):
        raise MessageError(f"{where} holds non-finite values")
    return t
