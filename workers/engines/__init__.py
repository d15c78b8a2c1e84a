"""Inference engines behind one protocol."""
