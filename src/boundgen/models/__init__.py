"""Decoder model, its layers, weight loading and the architecture registry."""
