"""boundgen: an inference engine for bounded generation workloads on small decoder LMs."""

__version__ = "0.1.0"
