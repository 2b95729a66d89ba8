"""Request fields outside the peer's request type.

A name close to one the route knows is a typo: refused with a 400 naming the field it resembles,
since ignoring `apply_sofmax` silently computes something else. Any other unknown field is handled
as the peer whose route it is handles it (docs/compat.md): ignored (SGLang, vLLM, Cohere, TEI), or
refused on boundgen's own `/v1/beam` (a request type with `extra="forbid"`).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from pydantic import BaseModel

from boundgen.server.errors import BadRequest

# difflib's ratio from which a name is a typo of a known one: one letter wrong, missing or extra in
# a name of 5 letters or more (`apply_sofmax` 0.96, `temprature` 0.95, `item` for `items` 0.89,
# `top_n` for `top_k` 0.8), or an old name of a field (`activation` for `use_activation` 0.83);
# two names that only share a stem stay apart (`query` and `queries` 0.67).
NEAR_MISS = 0.8

# Sampling knobs of the peers' generation APIs. No boundgen route has one (scores and beam search
# read the model's log-probabilities as they are), but a misspelling of one is still a typo of a
# knob the caller expects to act, so it is named like any other.
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "max_tokens",
    "max_new_tokens",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "length_penalty",
)
NO_SAMPLING = (
    "boundgen does not sample; scores and beam search use the log-probabilities as they are"
)


def check(model: type[BaseModel], names: Iterable[str]) -> None:
    """Refuse the first of `names` (a body's fields) that `model` does not declare and that is a
    near miss of a field it knows (declared, refused by name in its `UNSUPPORTED`, or a sampling
    knob); with `extra="forbid"`, refuse any field it does not declare."""
    declared = set(model.model_fields)
    refused = {name: why for name, (_, why) in getattr(model, "UNSUPPORTED", {}).items()}
    others = [*refused, *SAMPLING_FIELDS]
    for name in names:
        if name in declared or name in refused:
            continue
        if name not in SAMPLING_FIELDS:  # a sampling knob spelled right is no typo
            # a field the request takes first: `top_k` on a rerank means its `top_n`, not `top_p`
            close = _closest(name, declared) or _closest(name, others)
            if close:
                raise BadRequest(_did_you_mean(name, close, declared, refused))
        if model.model_config.get("extra") == "forbid":
            raise BadRequest(
                f"{name}: unknown field; this request takes {', '.join(sorted(declared))}"
            )


def _closest(name: str, known: Iterable[str]) -> str | None:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=NEAR_MISS)
    return close[0] if close else None


def _did_you_mean(name: str, match: str, declared: set[str], refused: dict[str, str]) -> str:
    message = f"{name}: unknown field; did you mean {match!r}?"
    if match in declared:
        return message
    return f"{message} (which is not supported: {refused.get(match, NO_SAMPLING)})"
