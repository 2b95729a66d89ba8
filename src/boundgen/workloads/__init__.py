"""Workloads as three stages: CPU `prepare_*` (tokenize → SequenceGroups), a device forward on a
`PackedBatch` through `ModelRunner`, and CPU `finish_*` (format results)."""
