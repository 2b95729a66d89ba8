"""A built bucket against the eager model: the largest |difference| of the last rows on a real batch
that fills about half of the bucket, in its layout (shared prefix or plain).

`boundgen compile` runs it in the worker that built the bucket (right after the build, while the
other buckets still compile) or, building in one process, over every bucket at the end.
"""

from __future__ import annotations

from pathlib import Path

import torch

from boundgen.compile.aoti import AOTIBucket, SharedWeights
from boundgen.compile.buckets import Bucket, BucketSet
from boundgen.models.decoder import DecoderModel
from boundgen.text.packing import SequenceGroup, pack


def _batch(bucket: Bucket, vocab: int, gen: torch.Generator):
    n = max(1, bucket.tokens // 2)
    ids = lambda k: torch.randint(1, vocab, (k,), generator=gen).tolist()
    if bucket.cascade:
        p = max(1, min(bucket.prefix_tokens - 1, n // 2))
        s = max(1, min(bucket.shared_tokens // 2, n - p) // 2)
        groups = [SequenceGroup(ids(p), [ids(s), ids(max(1, s - 1))])]
    else:
        seg = max(1, min(bucket.max_seqlen, n) // 2)
        groups = [SequenceGroup([], [ids(seg), ids(max(1, seg // 2))])]
    return pack(groups)


def max_abs_diff(
    model: DecoderModel,
    bucket: Bucket,
    path: str | Path,
    weights: SharedWeights | None = None,
    seed: int = 0,
) -> float | None:
    """max |compiled − eager| over the batch's last rows; None when the batch does not fit (a
    layout too small for the probe batch). Loads the package in this process: call it only where
    loading is safe (`compile.preload`)."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    batch = _batch(bucket, model.config.vocab_size, gen)
    chosen, padded = BucketSet([bucket]).pad(batch)
    if chosen is None:
        return None
    dev = padded.to(device)
    with torch.inference_mode():
        compiled = AOTIBucket.load(path, bucket, weights or SharedWeights(model), device)
        got = compiled(dev).index_select(0, dev.last_index)
        plain = batch.to(device)
        want = model(plain.input_ids, plain.positions, plain.attn)
        want = want.index_select(0, plain.last_index)
    return float((got.float() - want.float()).abs().max())
