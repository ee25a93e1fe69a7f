"""``secvfl train`` flags for the secure-computation protocols: ``--he``, ``--secagg`` and ``--secure-channel``.

* ``--he ckks`` (:class:`protocols.ckks.CKKSPlugin`): feature parties encrypt their outputs under the label party's
  CKKS public key; an added ``aggregator`` party sums the ciphertexts; the label party decrypts only the sum.
* ``--secagg mask`` (:class:`SecAggPlugin`): pairwise additive masks (:class:`protocols.secagg.MaskedAggregation`);
  the receiver learns the exact fixed-point sum and nothing about a single party's output. The parties' public keys
  for the masks are authenticated only when ``--secure-channel`` is on; without it a relay that swaps them can unmask
  a party, so the run warns (:class:`protocols.secagg.UnauthenticatedKeysWarning`).
* ``--secure-channel`` (:class:`ChannelPlugin`): every message is sealed end to end
  (:class:`protocols.channel.SecureChannelLayer`, stack position 90, the outermost layer). Identity keys come from
  ``--channel-keys DIR`` (``<party>.key.pem`` private keys and ``<party>.pub.pem`` pinned public keys: the keys of a
  deployment, where each party holds only its own ``.key.pem``), or, without it, every party's key is generated and
  pinned in this one process: that protects the bytes on the wire of this simulation but proves nothing about who the
  peers are, so it is never a deployment. The run says at its start which of the two it is
  (:class:`ChannelKeysWarning`).

Threat models are those of the protocol modules. ``--he`` and ``--secagg`` are alternatives (each replaces the plain
aggregation); asking for both is refused before training (by :func:`secvfl.plugins.configure_protocols`, where the
one-aggregation rule lives).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from protocols.channel import (
    ChannelCredentials,
    IdentityKey,
    PinnedKeys,
    SecureChannelLayer,
    require_outermost,
)
from protocols.ckks import CKKSPlugin
from protocols.secagg import MaskedAggregation, UnauthenticatedKeysWarning
from secvfl.errors import ConfigError, SecvflWarning, UnsupportedError
from secvfl.options import Options, option
from secvfl.plugins import ProtocolPlugin, ProtocolSetup
from secvfl.transport.layers import AlgorithmTraits, Topology

if TYPE_CHECKING:
    from secvfl.algorithms.base import Algorithm, RunContext
    from secvfl.config import TrainConfig

__all__ = ["CKKSTrainPlugin", "SecAggPlugin", "ChannelPlugin", "ChannelKeysWarning", "RunChannelLayer", "generate_channel_keys",
           "CHANNEL_POSITION", "SecAggOptions", "ChannelOptions"]

CHANNEL_POSITION = 90  # outermost: seals whatever the inner layers produced


class ChannelKeysWarning(SecvflWarning):
    """Where the secure channel's identity keys come from: generated in this process (a simulation, never a
    deployment) or key files (``--channel-keys``), of which this one process reads every party's private key."""


@dataclass(frozen=True)
class SecAggOptions(Options):
    secagg: Literal["none", "mask"] = option(
        "none", "masked secure aggregation of the parties' outputs (vafl, fdml): mask = pairwise additive masks "
                "(X25519 + AES-CTR); the label party learns only the sum. The parties' public keys for the masks are "
                "authenticated only with --secure-channel (without it, a relay that swaps them can unmask a party). "
                "Alternative to --he ckks")
    secagg_frac_bits: int = option(
        24, "fixed-point fractional bits of --secagg mask (precision 2^-(F+1) per party and element; values must stay "
            "below 2^(62-F)/parties)", metavar="F")


@dataclass(frozen=True)
class ChannelOptions(Options):
    secure_channel: bool = option(
        False, "seal every message end to end (SIGMA handshake: X25519, Ed25519 signatures and key confirmation over "
               "the whole transcript; AES-256-GCM); outermost layer. Also authenticates --secagg mask's keys")
    channel_keys: str | None = option(
        None, "folder with <party>.key.pem (mode 0600) and <party>.pub.pem for every party of the run (deployment "
              "keys); default: every party's key generated and pinned in this one process, a simulation only, never "
              "a deployment", metavar="DIR")


class SecAggPlugin(ProtocolPlugin):
    """``--secagg mask`` and ``--secagg-frac-bits`` for ``secvfl train``."""

    name = "secagg"
    options_type = SecAggOptions

    def configure(self, cfg: TrainConfig, traits: AlgorithmTraits, ctx: RunContext) -> ProtocolSetup | None:
        o = cfg.options_for(SecAggOptions)
        if o.secagg == "none":
            if o.secagg_frac_bits != 24:
                raise UnsupportedError("--secagg-frac-bits only applies with --secagg mask")
            return None
        aggregation = MaskedAggregation(frac_bits=o.secagg_frac_bits)
        problems = aggregation.check(traits)
        if problems:
            raise UnsupportedError("; ".join(problems))
        if not cfg.options_for(ChannelOptions).secure_channel:
            warnings.warn(
                "--secagg mask without --secure-channel: the parties' public keys for the masks are not "
                "authenticated, so whoever can modify the traffic between parties can swap them and read a party's "
                "individual output; add --secure-channel", UnauthenticatedKeysWarning, stacklevel=2)
        return ProtocolSetup(aggregation=aggregation, summary=lambda: {"secagg": aggregation.describe()})


class CKKSTrainPlugin(CKKSPlugin):
    """:class:`CKKSPlugin`, plus stopping its encryption workers when the run ends."""

    def configure(self, cfg: TrainConfig, traits: AlgorithmTraits, ctx: RunContext) -> ProtocolSetup | None:
        setup = super().configure(cfg, traits, ctx)
        if setup is not None and setup.aggregation is not None:
            aggregation = setup.aggregation

            def close(_run_dir: Path | None) -> None:
                aggregation.close()

            setup.on_finish.append(close)
        return setup


# -- secure channel --------------------------------------------------------------------------------------------
def generate_channel_keys(directory: str | Path, parties: list[str], *, overwrite: bool = False) -> Path:
    """Write ``<party>.key.pem`` (mode 0600) and ``<party>.pub.pem`` for each party into ``directory``.

    For trying ``--channel-keys`` on one machine; in a real deployment each party generates its own key on its own
    host and only the ``.pub.pem`` files are exchanged.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for party in parties:
        key = IdentityKey.generate()
        key.save(directory / f"{party}.key.pem", overwrite=overwrite)
        key.save_public(directory / f"{party}.pub.pem")
    return directory


class RunChannelLayer(SecureChannelLayer):
    """A :class:`SecureChannelLayer` whose credentials are resolved when the network is built.

    The run's parties (feature parties, label party and any aggregator an aggregation adds) are known only then,
    so the credentials are loaded from ``key_dir`` -- or generated for this run only when ``key_dir`` is None --
    in :meth:`bind`.
    """

    name: ClassVar[str] = "secure-channel"

    def __init__(self, key_dir: str | Path | None = None) -> None:  # noqa: D107 - credentials come in bind()
        self.key_dir = Path(key_dir) if key_dir is not None else None
        self._local = {}
        self.sealed = self.opened = self.rejected = 0

    def bind(self, topology: Topology) -> None:
        parties = sorted(topology.roles)
        if self.key_dir is None:
            keys = {p: IdentityKey.generate() for p in parties}
            pinned = PinnedKeys({p: k.public_key for p, k in keys.items()})
            credentials = {p: ChannelCredentials(k, pinned) for p, k in keys.items()}
        else:
            credentials = self._load(parties)
        SecureChannelLayer.__init__(self, credentials)
        super().bind(topology)

    def _load(self, parties: list[str]) -> dict[str, ChannelCredentials]:
        assert self.key_dir is not None
        if not self.key_dir.is_dir():
            raise ConfigError(f"--channel-keys {self.key_dir}: no such directory")
        missing = [f"{p}.{kind}.pem" for p in parties for kind in ("key", "pub")
                   if not (self.key_dir / f"{p}.{kind}.pem").is_file()]
        if missing:
            raise ConfigError(
                f"--channel-keys {self.key_dir} lacks {missing}; this run's parties are {parties}. Create them with "
                "protocols.secure_plugins.generate_channel_keys(DIR, parties) or drop --channel-keys to use keys "
                "generated for this run only"
            )
        pinned = PinnedKeys.from_dir(self.key_dir)
        return {p: ChannelCredentials(IdentityKey.load(self.key_dir / f"{p}.key.pem"), pinned) for p in parties}

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out["keys"] = (str(self.key_dir) if self.key_dir is not None else
                       "ephemeral (every party's key generated and pinned in this one process: simulation only)")
        return out


class ChannelPlugin(ProtocolPlugin):
    """``--secure-channel`` and ``--channel-keys DIR`` for ``secvfl train``."""

    name = "channel"
    options_type = ChannelOptions

    def configure(self, cfg: TrainConfig, traits: AlgorithmTraits, ctx: RunContext) -> ProtocolSetup | None:
        o = cfg.options_for(ChannelOptions)
        key_dir = o.channel_keys
        if not o.secure_channel:
            if key_dir:
                raise UnsupportedError("--channel-keys only applies with --secure-channel")
            return None
        if key_dir is None:
            statement = ("--secure-channel without --channel-keys: every party's identity key was generated and pinned "
                         "in this one process, so parties are authenticated only within this simulation; never use "
                         "this for a deployment (there, pass --channel-keys DIR with keys each party generated on its "
                         "own host)")
        else:
            statement = (f"--secure-channel with --channel-keys {key_dir}: identity keys come from the key files in "
                         f"{key_dir} and peers are pinned from its .pub.pem files (deployment keys); this one process "
                         "reads every party's .key.pem, which only a test on one host should do: in a deployment "
                         "each party keeps its own key on its own host")
        warnings.warn(statement, ChannelKeysWarning, stacklevel=2)
        layer = RunChannelLayer(key_dir)

        def handshake(algo: Algorithm) -> None:
            require_outermost(algo.net.layers)
            layer.establish(algo.net)

        return ProtocolSetup(
            layers=[(CHANNEL_POSITION, layer)],
            attach=[handshake],
            summary=lambda: {"security": {"secure_channel": True,
                                          "channel_keys": "key files (deployment keys)" if key_dir else
                                          "generated in this process (simulation only)",
                                          "messages_sealed": layer.sealed, "messages_opened": layer.opened}},
        )

