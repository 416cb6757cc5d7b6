"""Deciding what runs where and when: pure planning logic, and the dispatcher that applies it."""
