"""FP8 layer policies: which projections run in FP8, and whether a policy may be used for a model.

A policy names projections of the decoder layers (`layers.<i>.`), optionally restricted to some
layers:

    none                        nothing in FP8
    mlp                         gate_up_proj and down_proj of every layer
    mlp+attn-proj               the above + qkv_proj and o_proj
    selective                   the recommended selective policy (`ALIASES`)
    mlp:layers=1-2              the MLP of layers 1 and 2 only
    mlp:skip=0,-1               the MLP of every layer but the first and the last
    gate_up_proj:layers=0,2-3   one kind of projection (down_proj stays bf16) in some layers

Grammar: `none`, or `PROJ[+PROJ...][:layers=LIST][:skip=LIST]` where PROJ is a projection of
`PROJECTIONS` or a group of `GROUPS`, and LIST is comma-separated items `N` (0-based; negative
counts from the end) or `A-B` (inclusive). Only these projections can be named, so embed_tokens,
norms, attention math, lm_head / score head and softmax always stay in bf16/fp32. `parse_policy`
gives every spelling of a policy one canonical name (gate verdicts and compile caches are keyed by
it); a named policy's is the policy it stands for.

The engine asks `check_policy_allowed` before applying a policy: it refuses one that failed the
fidelity gate for this checkpoint (or was never checked) unless forced.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from boundgen.quant.fp8 import model_device, quantize_modules, resolve_mode
from boundgen.quant.gate_cache import checkpoint_hash, lookup_gate_result

log = logging.getLogger(__name__)

# Every projection a policy can put in FP8: its name in a policy -> module suffix under layers.<i>.
PROJECTIONS = {
    "gate_up_proj": "mlp.gate_up_proj",
    "down_proj": "mlp.down_proj",
    "qkv_proj": "self_attn.qkv_proj",
    "o_proj": "self_attn.o_proj",
}
GROUPS = {"mlp": ("gate_up_proj", "down_proj"), "attn-proj": ("qkv_proj", "o_proj")}
# Named policies that stand for a selective one. `selective`: of the policies tried on the trained
# demo model, the one with the most FP8 GEMM FLOPs that passes the fidelity gate (docs/fp8.md,
# "Choosing `selective`"); whether it pays is measured on the GPU.
ALIASES = {"selective": "mlp+qkv_proj:skip=0"}
# The named policies (`quant-check --fp8 all` checks every one but none); DESIGN §7 suggests mlp.
PRESETS = ("none", "mlp", "mlp+attn-proj", *ALIASES)
_ITEM = re.compile(r"^(?:(-?\d+)|(\d+)-(\d+))$")  # a LIST item: N, -N or A-B
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)$")


class Fp8PolicyError(RuntimeError):
    """A policy does not fit the model, or was refused by the fidelity gate."""


@dataclass(frozen=True)
class Fp8Policy:
    """A parsed policy. Layer indices may be negative (from the end) until resolved for a model."""

    projections: tuple[str, ...]  # keys of PROJECTIONS, in PROJECTIONS order; () is "none"
    layers: tuple[int, ...] | None = None  # only these layers; None: every layer
    skip: tuple[int, ...] = ()  # layers left in bf16

    @property
    def name(self) -> str:
        """The canonical spelling: groups where complete, options only where they restrict."""
        if not self.projections:
            return "none"
        rest = list(self.projections)
        parts = []
        for group, members in GROUPS.items():
            if all(p in rest for p in members):
                parts.append(group)
                rest = [p for p in rest if p not in members]
        name = "+".join(parts + rest)
        if self.layers is not None:
            name += f":layers={_format_layers(self.layers)}"
        if self.skip:
            name += f":skip={_format_layers(self.skip)}"
        return name

    def layer_indices(self, num_layers: int) -> list[int]:
        """The layers (0-based, ascending) whose projections go to FP8 in a `num_layers` model."""

        def resolve(i: int) -> int:
            j = i + num_layers if i < 0 else i
            if not 0 <= j < num_layers:
                raise Fp8PolicyError(
                    f"FP8 policy {self.name!r} names layer {i}, but the model has {num_layers} "
                    f"layers (0..{num_layers - 1})"
                )
            return j

        chosen = range(num_layers) if self.layers is None else {resolve(i) for i in self.layers}
        skipped = {resolve(i) for i in self.skip}
        return sorted(set(chosen) - skipped)


def _format_layers(indices: tuple[int, ...]) -> str:
    """Sorted, runs of 3+ consecutive layers as A-B, negative indices last: (3, 0, 1, 2, -1) ->
    "0-3,-1"."""
    pos = sorted(i for i in indices if i >= 0)
    items, start = [], 0
    while start < len(pos):
        end = start
        while end + 1 < len(pos) and pos[end + 1] == pos[end] + 1:
            end += 1
        if end - start >= 2:
            items.append(f"{pos[start]}-{pos[end]}")
        else:
            items += [str(i) for i in pos[start : end + 1]]
        start = end + 1
    items += [str(i) for i in sorted((i for i in indices if i < 0), reverse=True)]
    return ",".join(items)


def _syntax_error(policy: str, why: str) -> ValueError:
    projections = ", ".join([*GROUPS, *PROJECTIONS])
    return ValueError(
        f"unknown FP8 policy {policy!r} ({why}); choose one of: {', '.join(PRESETS)}, or write "
        f"PROJ[+PROJ][:layers=LIST][:skip=LIST] with PROJ from {projections} and LIST like 1-2 "
        f"or 0,-1"
    )


def _parse_layers(policy: str, key: str, text: str) -> tuple[int, ...]:
    out: set[int] = set()
    for item in text.split(","):
        m = _ITEM.match(item.strip())
        if not m:
            raise _syntax_error(policy, f"{key}: {item.strip()!r} is not N, -N or A-B")
        if m.group(1) is not None:
            out.add(int(m.group(1)))
        else:
            a, b = int(m.group(2)), int(m.group(3))
            if a > b:
                raise _syntax_error(policy, f"{key}: range {a}-{b} is empty")
            out.update(range(a, b + 1))
    return tuple(sorted(out))


def parse_policy(policy: str | None) -> Fp8Policy:
    """Parse a policy string (case and spaces ignored; None means "none"); ValueError saying what is
    wrong with it otherwise."""
    text = (policy or "none").strip().lower().replace(" ", "")
    text = ALIASES.get(text, text)
    if text == "none":
        return Fp8Policy(())
    head, *options = text.split(":")
    wanted = set()
    for part in head.split("+"):
        if part in GROUPS:
            wanted.update(GROUPS[part])
        elif part in PROJECTIONS:
            wanted.add(part)
        else:
            raise _syntax_error(policy, f"no projection or group named {part!r}")
    parsed: dict[str, tuple[int, ...]] = {}
    for option in options:
        key, eq, value = option.partition("=")
        if key not in ("layers", "skip") or not eq or not value:
            raise _syntax_error(policy, f"option {option!r} is not layers=LIST or skip=LIST")
        if key in parsed:
            raise _syntax_error(policy, f"{key} is given twice")
        parsed[key] = _parse_layers(policy, key, value)
    return Fp8Policy(
        tuple(p for p in PROJECTIONS if p in wanted), parsed.get("layers"), parsed.get("skip", ())
    )


def select_modules(model: nn.Module, policy: str) -> list[str]:
    """Names of the `nn.Linear` modules `policy` puts in FP8 (in model order).

    Raises if the policy is not "none" but the model has none of its modules (wrong names), or names
    a layer the model does not have, so a mismatch never silently runs everything in bf16.
    """
    parsed = parse_policy(policy)
    if not parsed.projections:
        return []
    suffixes = [PROJECTIONS[p] for p in parsed.projections]
    pattern = re.compile(
        r"(?:^|\.)layers\.(\d+)\.(" + "|".join(re.escape(s) for s in suffixes) + r")$"
    )
    modules = dict(model.named_modules())
    matched = {name: int(m.group(1)) for name in modules if (m := pattern.search(name))}
    if not matched:
        raise Fp8PolicyError(
            f"FP8 policy {parsed.name!r} matched no modules: expected nn.Linear modules named "
            f"layers.<i>.{{{', '.join(suffixes)}}}"
        )
    num_layers = 1 + max(int(m.group(1)) for name in modules if (m := _LAYER.search(name)))
    layers = set(parsed.layer_indices(num_layers))
    if not layers:
        raise Fp8PolicyError(
            f"FP8 policy {parsed.name!r} leaves none of {num_layers} layers in FP8"
        )
    selected = [name for name, layer in matched.items() if layer in layers]
    for name in selected:
        if type(modules[name]) is not nn.Linear:
            raise Fp8PolicyError(
                f"{name} is {type(modules[name]).__name__}, not nn.Linear (already quantized?)"
            )
    return selected


def apply_fp8(
    model: nn.Module, policy: str, *, emulate: bool = False, act_quant: str = "auto"
) -> nn.Module:
    """Swap the projections that `policy` names for `Fp8Linear`, in place; returns `model`.

    Raises `Fp8NotSupportedError` when real FP8 is asked for on a device that lacks it (pass
    `emulate=True` for quantize→dequantize numerics on any device).
    """
    return quantize_modules(
        model, select_modules(model, policy), emulate=emulate, act_quant=act_quant
    )


def check_policy_allowed(model_dir: str | Path, policy: str, force: bool = False) -> dict | None:
    """Whether the engine may run `policy` for the checkpoint in `model_dir`.

    Returns the stored gate record (None for "none" or a forced unchecked policy). Raises
    `Fp8PolicyError` saying why when the policy failed the fidelity gate for this checkpoint, or has
    not been checked; `force=True` logs a warning instead of raising.
    """
    name = parse_policy(policy).name
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
        if force:
            log.warning("%s; running it anyway", msg)
            return None
        raise Fp8PolicyError(msg)
    if not record.get("passed"):
        failures = "; ".join(record.get("failures", [])) or "see the stored report"
        msg = (
            f"FP8 policy {name!r} failed the fidelity gate for this checkpoint (sha256 "
            f"{digest[:12]}, checked {record.get('checked_at', '?')}): {failures}. Use a more "
            f"conservative policy (fewer projections or layers, or 'none') or force it"
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
) -> str:
    """The engine's one call: parse `policy`, refuse it if the gate failed (or never ran) for the
    checkpoint in `model_dir` unless forced, then swap the projections in place. Returns the
    policy's canonical name.

    Raises ValueError (not a policy), Fp8PolicyError (refused / names do not fit) or
    Fp8NotSupportedError (no FP8 on this device and not `emulate`) before touching the model.
    """
    name = parse_policy(policy).name
    if name == "none":
        return name
    select_modules(model, name)  # names fit?
    resolve_mode(model_device(model), emulate)  # device can run it?
    check_policy_allowed(model_dir, name, force=force)
    apply_fp8(model, name, emulate=emulate)
    return name
