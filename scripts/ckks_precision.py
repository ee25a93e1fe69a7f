"""How far a fresh wire-level CKKS ciphertext decrypts from what was encrypted, against the bound secvfl states.

Encrypts 20 ciphertexts of normal values (standard deviation 10) at the default parameters and prints the bound per
party (``CKKSParams.error_bound_per_party``), the worst error seen and their ratio. SEAL draws its noise from the
operating system, so the worst error varies a little from run to run. Used by BENCHMARKS.md ("Secure aggregation").

    python scripts/ckks_precision.py [--params default|small|compact] [--ciphertexts 20]
"""

from __future__ import annotations

import argparse

import numpy as np
import tenseal as ts

from protocols.ckks import CKKSParams
from protocols.ckks_cipher import CKKSCipher


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="default", help="a --ckks-params preset or N:PRIMES:SCALE")
    parser.add_argument("--ciphertexts", type=int, default=20)
    args = parser.parse_args()
    p = CKKSParams.parse(args.params)
    ctx = ts.context(ts.SCHEME_TYPE.CKKS, p.poly_modulus_degree, coeff_mod_bit_sizes=list(p.coeff_mod_bit_sizes),
                     n_threads=1)
    ctx.global_scale = 2.0**p.scale_bits
    cipher, rng, worst = CKKSCipher(ctx, p.wire_primes, 2.0**p.scale_bits), np.random.default_rng(0), 0.0
    for _ in range(args.ciphertexts):
        x = rng.normal(size=p.floats_per_ciphertext) * 10
        back = cipher.decrypt(cipher.load(cipher.encrypt_values(x)[0]), x.size)
        worst = max(worst, float(np.abs(back - x).max()))
    print(f"params {args.params}: bound per party {p.error_bound_per_party:.3g}, worst error {worst:.3g}, "
          f"{p.error_bound_per_party / worst:.0f}x below the bound")


if __name__ == "__main__":
    main()
