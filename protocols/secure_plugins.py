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
  deployment, where each party holds only its own ``.key.pem``; a party's process in ``secvfl party`` reads only its
  own), or, without it, in one process every party's key is generated and pinned there: that protects the bytes on
  the wire of this simulation but proves nothing about who the peers are, so it is never a deployment. Parties in
  separate processes without ``--channel-keys`` each generate their own key and pin their peers' from their
  mutual-TLS links (as trustworthy as the federation's CA). The run says at its start which it is
  (:class:`ChannelKeysWarning`; :class:`RunChannelLayer`).

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
    fingerprint,
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
    """Where the secure channel's identity keys come from: generated in this process (in one process: a simulation,
    never a deployment; in a party's own process: peers pinned from their mutual-TLS links) or key files
    (``--channel-keys``), of which one process running every party reads every party's private key."""


@dataclass(frozen=True)
class SecAggOptions(Options):
    secagg: Literal["none", "mask"] = option(
        "none", "masked secure aggregation of the parties' outputs (vafl, fdml): mask = pairwise additive masks "
                "(X25519 + AES-CTR); the label party learns only the sum. The parties' public keys for the masks are "
                "authenticated only with --secure-channel (without it, a relay that swaps them can unmask a party). "
                "Alternative to --he ckks")
    secagg_frac_bits: int = option(
        24, "fixed-point fractional bits of --secagg mask (precision 2^-(F+1) per party and element; values must stay "
            "below 2^(62-F)/parties)", metavar="F",
        # fewer bits round every summed value to within parties x 2^-(F+1): F = 0 rounds to whole numbers
        check=(lambda v: 16 <= v <= 52, "an integer from 16 to 52 (fewer bits round each summed value to within "
                                         "parties x 2^-(F+1), which spoils training; 52: float64's precision)"))


@dataclass(frozen=True)
class ChannelOptions(Options):
    secure_channel: bool = option(
        False, "seal every message end to end (SIGMA handshake: X25519, Ed25519 signatures and key confirmation over "
               "the whole transcript; AES-256-GCM); outermost layer. Also authenticates --secagg mask's keys")
    channel_keys: str | None = option(
        None, "folder with <party>.key.pem (mode 0600) and <party>.pub.pem for every party of the run (deployment "
              "keys; a party's own process, secvfl party, reads only its own .key.pem); default: every party's key "
              "generated and pinned in this one process, a simulation only, never a deployment (in secvfl party: "
              "generated by each party, peers pinned over their mutual-TLS links)", metavar="DIR")


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

    The run's parties (feature parties, label party and any aggregator an aggregation adds), and with the parties in
    separate processes the one this process acts for (``topology.local``), are known only then, so the credentials
    are set up in :meth:`bind`, for the parties of this process only:

    * ``key_dir`` given: each local party's private key from ``<party>.key.pem``, every party's public key pinned from
      the ``<party>.pub.pem`` files. A process of a deployment reads only its own ``.key.pem``.
    * in one process without ``key_dir``: every party's key generated and pinned here (a simulation only);
    * in a party's own process without ``key_dir``: its key generated here, each peer's pinned from the key that
      peer sends over their mutual-TLS link before their first handshake (``pin_from_transport``).

    The run says at its start which of these it is (:class:`ChannelKeysWarning`).
    """

    name: ClassVar[str] = "secure-channel"

    def __init__(self, key_dir: str | Path | None = None) -> None:  # noqa: D107 - credentials come in bind()
        self.key_dir = Path(key_dir) if key_dir is not None else None
        self._local = {}
        self.keys = "not set up yet"
        self.sealed = self.opened = self.rejected = 0

    def bind(self, topology: Topology) -> None:
        parties = sorted(topology.roles)
        me = topology.local
        own = [p for p in parties if me is None or p == me]  # none: a coordinator acting for no party (LASER-VFL)
        if self.key_dir is None:
            keys = {p: IdentityKey.generate() for p in own}
            pinned = PinnedKeys({p: k.public_key for p, k in keys.items()})
            credentials = {p: ChannelCredentials(k, pinned) for p, k in keys.items()}
        else:
            credentials = self._load(parties, own)
        self._setup(credentials, pin_from_transport=self.key_dir is None and me is not None)
        self.keys, statement = self._statement(me)
        warnings.warn(statement, ChannelKeysWarning, stacklevel=2)
        super().bind(topology)

    def _statement(self, me: str | None) -> tuple[str, str]:
        """(what summary.json says of the keys, what the run says at its start)."""
        d = self.key_dir
        if d is None and me is None:
            return ("generated in this process (simulation only)",
                    "--secure-channel without --channel-keys: every party's identity key was generated and pinned in "
                    "this one process, so parties are authenticated only within this simulation; never use this for "
                    "a deployment (there, pass --channel-keys DIR with keys each party generated on its own host)")
        if d is None:
            return ("generated by each party's process; peers pinned from their mutual-TLS links",
                    "--secure-channel without --channel-keys: each party's identity key is generated in its own "
                    "process and each peer's key is pinned from what that peer sends over its mutual-TLS link, so the "
                    "channel authenticates parties exactly as far as the federation's CA does; for pins that do not "
                    "depend on the CA, pass --channel-keys DIR with keys each party generated on its own host")
        if me is None:
            return ("key files (deployment keys)",
                    f"--secure-channel with --channel-keys {d}: identity keys come from the key files in {d} and peers "
                    "are pinned from its .pub.pem files (deployment keys); this one process reads every party's "
                    ".key.pem, which only a test on one host should do: in a deployment each party keeps its own key "
                    "on its own host")
        return ("key files (deployment keys): each party's process read only its own .key.pem",
                f"--secure-channel with --channel-keys {d}: each party's process reads only its own "
                f"<party>.key.pem and pins every party from the .pub.pem files in {d} (deployment keys, independent "
                "of the federation's CA)")

    def _load(self, parties: list[str], own: list[str]) -> dict[str, ChannelCredentials]:
        assert self.key_dir is not None
        if not self.key_dir.is_dir():
            raise ConfigError(f"--channel-keys {self.key_dir}: no such directory")
        missing = [f"{p}.{kind}.pem" for p in parties for kind in ("key", "pub")
                   if (kind == "pub" or p in own) and not (self.key_dir / f"{p}.{kind}.pem").is_file()]
        if missing:
            raise ConfigError(
                f"--channel-keys {self.key_dir} lacks {missing}; this run's parties are {parties}. Create them with "
                "protocols.secure_plugins.generate_channel_keys(DIR, parties) or drop --channel-keys to use keys "
                "generated for this run only"
            )
        pinned = PinnedKeys.from_dir(self.key_dir)
        credentials = {p: ChannelCredentials(IdentityKey.load(self.key_dir / f"{p}.key.pem"), pinned) for p in own}
        for p, c in credentials.items():
            if fingerprint(c.identity.public_key) != fingerprint(pinned.get(p)):  # type: ignore[arg-type]
                raise ConfigError(f"--channel-keys {self.key_dir}: {p}.key.pem does not match {p}.pub.pem (the peers "
                                  f"would refuse {p}'s signatures); export {p}.pub.pem from {p}.key.pem again")
        return credentials

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        if self.topology.local is None:
            out["keys"] = (str(self.key_dir) if self.key_dir is not None else
                           "ephemeral (every party's key generated and pinned in this one process: simulation only)")
        else:
            out["keys"] = f"{self.key_dir}: {self.keys}" if self.key_dir is not None else self.keys
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
        layer = RunChannelLayer(key_dir)  # says where its keys come from once it knows its parties (bind)

        def handshake(algo: Algorithm) -> None:
            require_outermost(algo.net.layers)
            if algo.net.topology.local is None:  # parties in separate processes handshake at each epoch's start,
                layer.establish(algo.net)        # once the transport between their processes is up

        return ProtocolSetup(
            layers=[(CHANNEL_POSITION, layer)],
            attach=[handshake],
            summary=lambda: {"security": {"secure_channel": True, "channel_keys": layer.keys,
                                          "messages_sealed": layer.sealed, "messages_opened": layer.opened}},
        )

