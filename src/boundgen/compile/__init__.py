"""Compiled model nodes: shape buckets, AOTInductor packages with shared weights, CUDA graphs, the
artifact cache, and the backend choice (`backends`). Passes over a plain `DecoderModel`; the runner
plugs them in (see docs/compile.md)."""
