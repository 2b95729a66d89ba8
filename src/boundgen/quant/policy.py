"""FP8 layer policies: which projections run in FP8, and whether a policy may be used for a model.

A policy names module suffixes under `layers.<i>.`; everything else (embed_tokens, norms, attention
math,
lm_head / score head, softmax) stays in bf16/fp32. The engine asks `check_policy_allowed` before
applying a
policy: it refuses one that failed the fidelity gate for this checkpoint (or was never checked)
unless forced.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from torch import nn

log = logging.getLogger(__name__)

POLICIES: dict[str, tuple[str, ...]] = {
    "none": (),
    "mlp": ("mlp.gate_up_proj", "mlp.down_proj"),
    "mlp+attn-proj": (
        "mlp.gate_up_proj",
        "mlp.down_proj",
        "self_attn.qkv_proj",
        "self_attn.o_proj",
    ),
}
# DESIGN §7: MLP in FP8 by default; confirm with benchmarks/bench_fp8.py (docs/fp8.md has the
# numbers).
DEFAULT_POLICY = "mlp"
# Never quantized, whatever the policy (checked by select_modules as a guard).
KEEP_HIGH_PRECISION = ("embed_tokens", "lm_head", "score", "norm", "q_norm", "k_norm")


class Fp8PolicyError(RuntimeError):
    """A policy is unknown, does not fit the model, or was refused by the fidelity gate."""


def parse_policy(policy: str | None) -> str:
    name = (policy or "none").strip().lower()
    if name not in POLICIES:
        raise ValueError(f"unknown FP8 policy {policy!r}; choose one of: {', '.join(POLICIES)}")
    return name


def select_modules(model: nn.Module, policy: str) -> list[str]:
    """Names of the `nn.Linear` modules `policy` puts in FP8 (in model order).

    Raises if the policy is not "none" but the model has none of its modules (wrong names), so a
    mismatch never silently runs everything in bf16.
    """
    name = parse_policy(policy)
    suffixes = POLICIES[name]
    if not suffixes:
        return []
    pattern = re.compile(
        r"(?:^|\.)layers\.\d+\.(" + "|".join(re.escape(s) for s in suffixes) + r")$"
    )
    selected = []
    for module_name, module in model.named_modules():
        if not pattern.search(module_name):
            continue
        if module_name.rsplit(".", 1)[-1] in KEEP_HIGH_PRECISION:  # pragma: no cover - guard
            continue
        if type(module) is not nn.Linear:
            raise Fp8PolicyError(
                f"{module_name} is {type(module).__name__}, not nn.Linear (already quantized?)"
            )
        selected.append(module_name)
    if not selected:
        raise Fp8PolicyError(
            f"FP8 policy {name!r} matched no modules: expected nn.Linear modules named "
            f"layers.<i>.{{{', '.join(suffixes)}}}"
        )
    return selected


def check_policy_allowed(
    model_dir: str | Path, policy: str, force: bool = False, allow_unchecked: bool = False
) -> dict | None:
    """Whether the engine may run `policy` for the checkpoint in `model_dir`.

    Returns the stored gate record (None for "none" or a forced/unchecked policy). Raises
    `Fp8PolicyError`
    saying why when the policy failed the fidelity gate for this checkpoint, or has not been checked
    (unless `allow_unchecked`); `force=True` logs a warning instead of raising.
    """
    from boundgen.quant.gate_cache import checkpoint_hash, lookup_gate_result

    name = parse_policy(policy)
    if name == "none":
        return None
    digest = checkpoint_hash(model_dir)
    record = lookup_gate_result(model_dir, name, digest=digest)
    how_to = f"run `boundgen quant-check --model {model_dir} --fp8 {name}`"
    if record is None:
        msg = (
            f"FP8 policy {name!r} has not passed the fidelity gate for this checkpoint "
            f"(sha256 {digest[:12]}): {how_to}, or force it"
        )
        if force or allow_unchecked:
            log.warning("%s; running it anyway", msg)
            return None
        raise Fp8PolicyError(msg)
    if not record.get("passed"):
        failures = "; ".join(record.get("failures", [])) or "see the stored report"
        msg = (
            f"FP8 policy {name!r} failed the fidelity gate for this checkpoint (sha256 {digest[:12]}, "
            f"checked {record.get('checked_at', '?')}): {failures}. Use a more conservative policy "
            f"(e.g. 'mlp' or 'none') or force it"
        )
        if force:
            log.warning("%s; forced, running it anyway", msg)
            return record
        raise Fp8PolicyError(msg)
    return record


def enable_fp8(
    model: nn.Module,
    model_dir: str | Path,
    policy: str | None,
    *,
    force: bool = False,
    emulate: bool = False,
    act_quant: str = "auto",
    allow_unchecked: bool = False,
) -> str:
    """The engine's one call: normalize `policy`, refuse it if the gate failed (or never ran) for the
    checkpoint in `model_dir` unless forced, then swap the projections in place. Returns the policy
    name.

    Raises Fp8PolicyError (refused / names do not fit) or Fp8NotSupportedError (no FP8 on this
    device
    and not `emulate`) before touching the model.
    """
    from boundgen.quant.fp8 import _model_device, apply_fp8, resolve_mode

    name = parse_policy(policy)
    if name == "none":
        return name
    select_modules(model, name)  # names fit?
    resolve_mode(_model_device(model), emulate)  # device can run it?
    check_policy_allowed(model_dir, name, force=force, allow_unchecked=allow_unchecked)
    apply_fp8(model, name, emulate=emulate, act_quant=act_quant)
    return name
