"""Handles of VIM's ADMM parties: the requests the coordinator may make of them (see :mod:`secvfl.handles`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from secvfl.algorithms.vim.model import HEAD
from secvfl.algorithms.vim.noise import NoisyFeatureHandle
from secvfl.algorithms.vim.parties import DUAL_KIND, HEAD_KIND, ADMMFeatureParty, ADMMLabelParty
from secvfl.handles import LabelHandle, request

__all__ = ["ADMMFeatureHandle", "ADMMLabelHandle", "HeadsLabelHandle"]


class ADMMFeatureHandle(NoisyFeatureHandle):
    """An :class:`ADMMFeatureParty`: ``forward`` as every feature party, then ``local_update`` instead of
    ``backward``."""

    _party: ADMMFeatureParty

    @request
    def local_update(self, *, sender: str) -> None:
        """Take the round's dual (and, for VIMADMM, head) message ``sender`` sent from the network and run the
        party's local steps on the batch of its last training output."""
        dual = self._receive(DUAL_KIND, sender)
        head = None if self._party.joint else self._receive(HEAD_KIND, sender)
        self._party.local_update(dual, head)

    @request
    def head_norm(self) -> float:
        """``||W_k||_F`` of the party's own head (VIMADMM-J): the one number it reveals for party importance."""
        weight = self._party.model[HEAD].weight
        return float(weight.detach().norm())


class HeadsLabelHandle(LabelHandle):
    """A label party that holds the parties' linear heads (:class:`~secvfl.algorithms.vim.model.PartyHeads`)."""

    @request
    def head_norms(self) -> list[float]:
        """``||W_k||_F`` of the heads the label party holds, in party order (public facts it chooses to report)."""
        return self._party.head.norms()


class ADMMLabelHandle(HeadsLabelHandle):
    """An :class:`ADMMLabelParty` (the coordinator's own process): ``receive`` as every label party, then
    ``admm_step`` instead of ``train_step``."""

    _party: ADMMLabelParty

    @request
    def admm_step(self, step: int, ids: np.ndarray, senders: Sequence[str]) -> float:
        """The label party's part of a round on the received outputs; sends each of ``senders`` its messages.
        Returns the batch loss (before the round's updates)."""
        loss, messages = self._party.admm_step(step, ids, self._take(), senders, aggregated=self._aggregated)
        self._send(messages)
        return float(loss)  # after the send: on a GPU the round has run by now, so reading it does not wait
