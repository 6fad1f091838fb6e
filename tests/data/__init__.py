"""Tests for megatron.data."""
