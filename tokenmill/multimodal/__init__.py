"""Multimodal input: images and video frames for LLaVA-style models (docs/multimodal.md)."""
