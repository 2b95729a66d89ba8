"""Compiled model nodes: shape buckets, AOTInductor packages with shared weights, CUDA graphs, artifact
cache, and the backend choice (`eager` | `compile` | `aoti`, each optionally `+graphs`; `auto`).

Passes over a plain `DecoderModel`; they plug in at `ModelRunner` (see docs/compile.md).
"""

from boundgen.compile.buckets import Bucket, BucketSet, parse_buckets
from boundgen.compile.cache import ArtifactCache, ArtifactError
from boundgen.compile.preload import AOTIUnsafe, cli_startup
from boundgen.compile.runner import BACKENDS, BucketedRunner, CompileOptions, make_runner

__all__ = [
    "BACKENDS",
    "AOTIUnsafe",
    "ArtifactCache",
    "ArtifactError",
    "Bucket",
    "BucketSet",
    "BucketedRunner",
    "CompileOptions",
    "cli_startup",
    "make_runner",
    "parse_buckets",
]
