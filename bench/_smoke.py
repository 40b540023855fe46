"""Shared by every bench: its smoke size, ``--smoke``.

``python bench/NAME.py --smoke`` runs the bench on tiny inputs with one repeat, in seconds where it
can, and prints the same last line (``NAME: key=value; ...``) as at full size: tests/test_benches.py
runs every bench so, to keep them from rotting. Its numbers mean nothing. Flags given explicitly win
over the smoke values.
"""

from __future__ import annotations

import argparse

HELP = "smoke size: tiny inputs, one repeat; checks that the bench runs (its numbers mean nothing)"


def parse_args(ap: argparse.ArgumentParser, argv: list[str] | None = None, **smoke) -> argparse.Namespace:
    """``ap``'s arguments plus ``--smoke``, which makes ``smoke`` (dest -> value) the defaults."""
    ap.add_argument("--smoke", action="store_true", help=HELP)
    known, _ = ap.parse_known_args(argv)
    if known.smoke:
        ap.set_defaults(**smoke)
    return ap.parse_args(argv)


def add_policy_args(ap: argparse.ArgumentParser, base_help: str, n_prompts: int) -> None:
    """The lab-policy arguments of the export benches: a checkpoint or a lab size to build, the
    measured prompts and the W4A4 calibration prompts."""
    ap.add_argument("base", nargs="?", help=base_help)
    ap.add_argument("--size", default="demo", help="lab policy size built without a checkpoint")
    ap.add_argument("--sft-steps", type=int, default=None, help="its warm start (default: the lab's)")
    ap.add_argument("--prompts", type=int, default=n_prompts, help="measured prompts (half training, half held-out)")
    ap.add_argument("--calibration", type=int, default=64, help="W4A4 calibration prompts")
